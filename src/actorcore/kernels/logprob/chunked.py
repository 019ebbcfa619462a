"""Chunked torch backend: fp32 logits for a bounded number of tokens at a time, recomputed in backward.

Shape suffixes: T tokens, D hidden, V vocab, C tokens of one chunk.

Memory: at most a few [C, V] fp32 buffers live at once (forward: logits and exp; backward: logits,
probabilities and, with softcap, tanh). The default C keeps one such buffer at about
``CHUNK_BYTES`` (256 MiB): C = 256 MiB / (4 * V), rounded down to a multiple of 64 (441 -> 384 rows at
V = 151936, all tokens at V = 131). That bounds peak memory independent of T while keeping the
matmuls large enough to run near peak.

Batch-invariant forward (``batch_invariant=True``): every chunk has exactly C rows (at most
``batch_invariant.TILE_ROWS`` by default), the last one padded with zero rows, and all its reductions run
on the padded chunk: a token's statistics then come from calls of one shape whatever the other tokens are.

Precision: logits come from fp32 matmuls (``torch.mm(out_dtype=float32)`` on CUDA for 16-bit inputs,
else an fp32 copy of the operands); they are never rounded to 16 bits. On CUDA, grad_logits are cast
to the input dtype for the two gradient matmuls (as Liger does), with fp32 accumulation and an fp32
grad_weight accumulator; on CPU everything stays fp32.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

from actorcore.kernels.batch_invariant import TILE_ROWS
from actorcore.kernels.logprob._common import compute_dtype, mm_out_fp32
from actorcore.kernels.trace import add

logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 20


def default_chunk_rows(vocab: int, bytes_per_elem: int = 4, budget: int = CHUNK_BYTES) -> int:
    """Rows of a [rows, vocab] buffer that fit in ``budget`` bytes (multiple of 64 when >= 64)."""
    rows = max(1, budget // (bytes_per_elem * vocab))
    return rows - rows % 64 if rows >= 64 else rows


class _WeightCache:
    """Lazily made compute-dtype copy of the weight, only when a direct fp32-output matmul is unavailable."""

    def __init__(self, weight_VD: torch.Tensor, cdt: torch.dtype):
        self.weight_VD = weight_VD
        self.cdt = cdt
        self._w = weight_VD if weight_VD.dtype == cdt else None

    def get(self) -> torch.Tensor:
        if self._w is None:
            self._w = self.weight_VD.to(self.cdt)
        return self._w


def _logits(h_CD: torch.Tensor, wc: _WeightCache, trace: Counter[str] | None) -> torch.Tensor:
    """[C, V] logits in the compute dtype, never rounded to 16 bits (counted in ``trace``)."""
    if h_CD.dtype == wc.cdt:
        out = h_CD @ wc.get().t()
    else:
        out = mm_out_fp32(h_CD, wc.weight_VD.t()) if h_CD.is_cuda else None
        if out is None:
            out = h_CD.to(wc.cdt) @ wc.get().t()
    add(trace, "logprob:torch_chunk")
    add(trace, "logprob:torch_chunk_rows", out.shape[0])
    return out


def _local_labels(labels_C: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index clamped into [0, V), mask of labels that this vocabulary range owns)."""
    valid = (labels_C >= 0) & (labels_C < vocab)
    return labels_C.clamp(0, vocab - 1).long(), valid


def _padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` ([n, ...], n <= rows) followed by zero rows up to ``rows``."""
    if x.shape[0] == rows:
        return x
    out = x.new_zeros(rows, *x.shape[1:])
    out[: x.shape[0]] = x
    return out


@dataclass(frozen=True)
class TorchChunkedEngine:
    """Forward statistics and backward gradients in token chunks with plain torch ops (stateless).

    ``batch_invariant``: forward chunks of one fixed size (the last padded), see the module docstring.
    """

    batch_invariant: bool = False

    name = "torch"

    def forward_rows(self, vocab: int, chunk_size: int | None) -> int:
        """Tokens per forward chunk; with ``batch_invariant`` a function of the vocabulary alone."""
        if chunk_size:
            return chunk_size
        rows = default_chunk_rows(vocab)
        return min(rows, TILE_ROWS) if self.batch_invariant else rows

    def forward_stats(self, hidden_TD, weight_VD, labels_T, *, temperature, softcap, entropy, chunk_size,
                      trace=None):
        n_tok, vocab = hidden_TD.shape[0], weight_VD.shape[0]
        cdt = compute_dtype(hidden_TD.dtype)
        rows = self.forward_rows(vocab, chunk_size)
        wc = _WeightCache(weight_VD, cdt)
        dev = hidden_TD.device
        m_T = torch.empty(n_tok, dtype=cdt, device=dev)
        s_T = torch.empty(n_tok, dtype=cdt, device=dev)
        zy_T = torch.empty(n_tok, dtype=cdt, device=dev)
        a_T = torch.empty(n_tok, dtype=cdt, device=dev) if entropy else None
        for start in range(0, n_tok, rows):
            end = min(start + rows, n_tok)
            n = end - start
            h_CD, labels_C = hidden_TD[start:end], labels_T[start:end]
            if self.batch_invariant:  # every chunk the same shape: reductions and matmuls of one shape
                h_CD, labels_C = _padded_rows(h_CD, rows), _padded_rows(labels_C, rows)
            z_CV = _logits(h_CD, wc, trace)
            if softcap is not None:
                z_CV.div_(softcap).tanh_().mul_(softcap)
            if temperature != 1.0:
                z_CV.div_(temperature)
            idx_C, valid_C = _local_labels(labels_C, vocab)
            zy_T[start:end] = (z_CV.gather(1, idx_C.unsqueeze(1)).squeeze(1) * valid_C)[:n]
            m_C = z_CV.amax(dim=1)
            m_T[start:end] = m_C[:n]
            z_CV.sub_(m_C.unsqueeze(1))
            e_CV = torch.exp(z_CV)
            s_T[start:end] = e_CV.sum(dim=1)[:n]
            if a_T is not None:
                a_T[start:end] = e_CV.mul_(z_CV).sum(dim=1)[:n]
            del z_CV, e_CV
        return m_T, s_T, a_T, zy_T

    def backward(
        self,
        hidden_TD,
        weight_VD,
        labels_T,
        lse_T,
        ent_T,
        grad_logprob_T,
        grad_ent_T,
        *,
        temperature,
        softcap,
        chunk_size,
        need_hidden,
        need_weight,
        trace=None,
    ):
        n_tok, vocab = hidden_TD.shape[0], weight_VD.shape[0]
        cdt = compute_dtype(hidden_TD.dtype)
        rows = chunk_size or default_chunk_rows(vocab)
        wc = _WeightCache(weight_VD, cdt)
        low_precision_mm = hidden_TD.is_cuda and hidden_TD.dtype != cdt
        grad_h = torch.empty_like(hidden_TD) if need_hidden else None
        grad_w = torch.zeros(weight_VD.shape, dtype=cdt, device=weight_VD.device) if need_weight else None
        for start in range(0, n_tok, rows):
            end = min(start + rows, n_tok)
            g_CV = self._grad_logits(
                _logits(hidden_TD[start:end], wc, trace),
                labels_T[start:end],
                lse_T[start:end],
                None if ent_T is None else ent_T[start:end],
                None if grad_logprob_T is None else grad_logprob_T[start:end],
                None if grad_ent_T is None else grad_ent_T[start:end],
                temperature,
                softcap,
            )
            h_CD = hidden_TD[start:end]
            if low_precision_mm:
                g_CV = g_CV.to(hidden_TD.dtype)
                if grad_h is not None:
                    grad_h[start:end] = g_CV @ weight_VD
                if grad_w is not None:
                    part = mm_out_fp32(g_CV.t(), h_CD)
                    grad_w += part if part is not None else (g_CV.t() @ h_CD).to(cdt)
            else:
                if grad_h is not None:
                    grad_h[start:end] = (g_CV @ wc.get()).to(hidden_TD.dtype)
                if grad_w is not None:
                    grad_w.addmm_(g_CV.t(), h_CD.to(cdt))
            del g_CV
        return grad_h, (grad_w.to(weight_VD.dtype) if grad_w is not None else None)

    @staticmethod
    def _grad_logits(l_CV, labels_C, lse_C, ent_C, g_lp_C, g_ent_C, temperature, softcap):
        """d(sum g_lp*logprob + g_ent*entropy) / d raw logits, in place in ``l_CV`` where possible.

        With z = cap(l)/T, logp = z - lse, p = exp(logp):
          d logprob/dz_j = 1[j=y] - p_j,  d entropy/dz_j = -p_j (logp_j + entropy).
        """
        vocab = l_CV.shape[1]
        t_CV = None
        if softcap is not None:
            t_CV = l_CV.div_(softcap).tanh_()
            z_CV = t_CV * softcap
            if temperature != 1.0:
                z_CV.div_(temperature)
        else:
            z_CV = l_CV
            if temperature != 1.0:
                z_CV.div_(temperature)
        logp_CV = z_CV.sub_(lse_C.unsqueeze(1))
        p_CV = torch.exp(logp_CV)
        if g_ent_C is not None:
            g_CV = logp_CV.add_(ent_C.unsqueeze(1)).mul_(-g_ent_C.unsqueeze(1))
            if g_lp_C is not None:
                g_CV.sub_(g_lp_C.unsqueeze(1))
            g_CV.mul_(p_CV)
        else:
            g_CV = p_CV.mul_(-g_lp_C.unsqueeze(1))
        del p_CV
        if g_lp_C is not None:
            idx_C, valid_C = _local_labels(labels_C, vocab)
            g_CV.scatter_add_(1, idx_C.unsqueeze(1), (g_lp_C * valid_C).unsqueeze(1))
        if temperature != 1.0:
            g_CV.div_(temperature)
        if t_CV is not None:
            g_CV.mul_(1.0 - t_CV.square_())
        return g_CV
