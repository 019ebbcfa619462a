"""Triton engine (CUDA, bf16/fp16 inputs): launches the fused lm-head kernels of ``triton_kernels`` and
``triton_fused_kernels``.

Shape suffixes: T tokens, D hidden, V vocab (this rank's rows under tensor parallelism), C tokens of one
block or chunk, B vocabulary rows of one backward block, S vocabulary splits of the forward grid.
Imported only when the Triton backend is chosen (it imports triton); the tile, split and block sizes
come from ``triton_blocking`` (pure arithmetic, tested on the CPU).

Forward: one launch over a grid of (token tile x vocabulary split). Each program streams its split of
the vocabulary in [BLOCK_T, BLOCK_V] logit tiles (tl.dot, fp32 accumulators: logits are never rounded
to 16 bits; TMA loads where the layout allows) and keeps per-token online statistics. The [S, T]
partials are merged by a few torch ops. Memory: O(T * S) floats.

Backward, per block of C tokens and B vocabulary rows: a persistent Triton kernel (one program per SM,
TMA loads and stores) recomputes the logits tile by tile and writes grad_logits (fp32 math, stored in the
input dtype, as Liger does) into a [C, B] workspace; cuBLAS then accumulates grad_hidden[C] += G @ W[B]
into an fp32 [C, D] accumulator (rounded to the input dtype once per token block) and
grad_weight[B] += G^T @ h[C] (fp32 inside each matmul, rounded to the weight dtype once per token
block). Blocking the vocabulary as well as the tokens keeps the workspace small (64 MiB). Layouts TMA
cannot load run the one-tile-per-program pointer-load kernel. No atomics: results are identical run to run.

Loss-fused forward (``fused_loss.py``), per chunk of up to 2048 tokens: one Triton launch computes the
logits, folds them into fp32 statistics and stores them as fp16 z - m (``triton_fused_kernels``); the
caller gives the per-token loss gradients; a memory-bound pass turns the fp16 values into 16-bit
grad_logits in place; cuBLAS forms grad_hidden = G @ W and grad_weight += G^T @ h: 6NHV instead of 8NHV.
A benchmark can take a chunk's statistics and the grad_weight product from other GEMMs by overriding
``_stats_and_shifted_logits`` / ``_shift_cols`` / ``_accumulate_grad_weight`` (``bench/quack_stats.py`` does, with
quack's warp-specialised GEMM: measured no faster end to end, docs/bench_head.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

import actorcore.kernels.logprob.triton_fused_kernels as fused_kernels
import actorcore.kernels.logprob.triton_kernels as kernels
from actorcore.kernels.logprob._common import finish_stats, merge_partial_stats
from actorcore.kernels.logprob.triton_blocking import (
    BACKWARD_VOCAB_BLOCK,
    BACKWARD_WORKSPACE_BYTES,
    BWD_CONFIG,
    FUSED_LOSS_WORKSPACE_BYTES,
    FWD_CONFIG,
    LOSS_CONFIG,
    Config,
    backward_blocks,
    cdiv,
    forward_grid,
    loss_chunk_rows,
    padded_row,
    tma_compatible,
)
from actorcore.kernels.trace import add


@dataclass(frozen=True)
class TritonEngine:
    """Engine for ``LinearLogprobEntropyFunction`` and the loss-fused head; immutable options only.

    ``fwd`` / ``bwd`` / ``loss``: tile configurations of the forward, grad_logits and loss-fused kernels.
    ``loss_workspace_bytes``: the loss-fused chunk buffer (``triton_blocking.loss_chunk_rows``).
    ``vocab_block`` / ``workspace_bytes``: the backward's blocking (``triton_blocking.backward_blocks``).
    ``batch_invariant``: forward statistics that do not depend on the other tokens of the call (a vocabulary
    split fixed by the vocabulary; each token's row of a logits tile never depends on the other rows).
    """

    fwd: Config = FWD_CONFIG
    bwd: Config = BWD_CONFIG
    loss: Config = LOSS_CONFIG
    loss_workspace_bytes: int = FUSED_LOSS_WORKSPACE_BYTES
    vocab_block: int = BACKWARD_VOCAB_BLOCK
    workspace_bytes: int = BACKWARD_WORKSPACE_BYTES
    batch_invariant: bool = False

    name = "triton"

    # ------------------------------------------------------------------ forward
    def forward_stats(self, hidden_TD, weight_VD, labels_T, *, temperature, softcap, entropy, chunk_size,
                      trace=None):
        """One launch over (token tiles x vocabulary splits); ``chunk_size`` does not apply (O(T) memory)."""
        labels_T = labels_T.contiguous()
        n_tok, dim = hidden_TD.shape
        vocab = weight_VD.shape[0]
        cfg = self.fwd
        t_tiles, tiles_per_split, num_splits = forward_grid(n_tok, vocab, cfg, _sm_count(hidden_TD),
                                                            self.batch_invariant)
        m_ST = torch.empty(num_splits, n_tok, dtype=torch.float32, device=hidden_TD.device)
        s_ST = torch.empty_like(m_ST)
        zy_ST = torch.empty_like(m_ST)
        a_ST = torch.empty_like(m_ST) if entropy else None
        grid = (t_tiles * num_splits,)
        common = dict(
            HAS_SOFTCAP=softcap is not None, ENTROPY=entropy, TILES_PER_SPLIT=tiles_per_split,
            BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        outs = (m_ST, s_ST, a_ST if entropy else m_ST, zy_ST)
        if tma_compatible(hidden_TD, weight_VD):
            add(trace, "logprob:triton_forward_tma")
            kernels.fwd_stats_kernel_tma[grid](
                _desc(hidden_TD, [cfg.block_t, cfg.block_k]), _desc(weight_VD, [cfg.block_v, cfg.block_k]),
                labels_T, *outs, n_tok, vocab, dim, num_splits, *_scalars(temperature, softcap), FLATTEN=cfg.flatten,
                **common,
            )
        else:
            kernels.fwd_stats_kernel[grid](
                hidden_TD, weight_VD, labels_T, *outs,
                n_tok, vocab, dim,
                hidden_TD.stride(0), hidden_TD.stride(1), weight_VD.stride(0), weight_VD.stride(1),
                num_splits, *_scalars(temperature, softcap), EVEN_K=dim % cfg.block_k == 0, **common,
            )
        add(trace, "logprob:triton_forward")
        return merge_partial_stats(m_ST, s_ST, a_ST, zy_ST)

    # ------------------------------------------------------------------ backward
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
        """Blocked over tokens and vocabulary rows (``backward_blocks``)."""
        n_tok, dim = hidden_TD.shape
        vocab = weight_VD.shape[0]
        rows, rows_v = backward_blocks(
            n_tok, dim, vocab, need_hidden=need_hidden, chunk_size=chunk_size, vocab_block=self.vocab_block,
            budget=self.workspace_bytes,
        )
        dev = hidden_TD.device
        work_CB = torch.empty(rows, padded_row(rows_v), dtype=hidden_TD.dtype, device=dev)
        one_block = rows_v == vocab
        acc_CD = torch.empty(rows, dim, dtype=torch.float32, device=dev) if need_hidden and not one_block else None
        labels_T = labels_T.contiguous()
        grad_h = torch.empty(hidden_TD.shape, dtype=hidden_TD.dtype, device=dev) if need_hidden else None
        grad_w = torch.empty(weight_VD.shape, dtype=weight_VD.dtype, device=dev) if need_weight else None
        has_glp, has_gent = grad_logprob_T is not None, grad_ent_T is not None
        dummy = lse_T
        flags = dict(HAS_SOFTCAP=softcap is not None, HAS_GLP=has_glp, HAS_GENT=has_gent)
        for start in range(0, n_tok, rows):
            end = min(start + rows, n_tok)
            n_c = end - start
            h_CD = hidden_TD[start:end]
            per_tok = (
                labels_T[start:end],
                lse_T[start:end],
                ent_T[start:end] if has_gent else dummy,
                grad_logprob_T[start:end] if has_glp else dummy,
                grad_ent_T[start:end] if has_gent else dummy,
            )
            for v0 in range(0, vocab, rows_v):
                v1 = min(v0 + rows_v, vocab)
                w_BD = weight_VD[v0:v1]
                g_CB = work_CB[:n_c, : v1 - v0]
                self._grad_logits(h_CD, w_BD, v0, per_tok, g_CB, flags, _scalars(temperature, softcap))
                add(trace, "logprob:triton_backward")
                if need_hidden and one_block:
                    torch.mm(g_CB, w_BD, out=grad_h[start:end])
                elif need_hidden and v0 == 0:
                    _mm_fp32(g_CB, w_BD, acc_CD[:n_c])
                elif need_hidden:
                    _addmm_fp32(acc_CD[:n_c], g_CB, w_BD)
                if need_weight and start == 0:
                    torch.mm(g_CB.t(), h_CD, out=grad_w[v0:v1])
                elif need_weight:
                    grad_w[v0:v1].addmm_(g_CB.t(), h_CD)
            if need_hidden and not one_block:
                grad_h[start:end].copy_(acc_CD[:n_c])
        return grad_h, grad_w

    def _grad_logits(self, h_CD, w_BD, v_start, per_tok, g_CB, flags, scalars):
        """g_CB = grad_logits of (tokens h_CD) x (vocabulary rows w_BD), logits recomputed in Triton."""
        cfg = self.bwd
        (n_c, dim), n_v = h_CD.shape, w_BD.shape[0]
        if cfg.persistent and tma_compatible(h_CD, w_BD, g_CB):
            programs = min(cdiv(n_c, cfg.block_t) * cdiv(n_v, cfg.block_v), _sm_count(h_CD))
            fused_kernels.bwd_grad_logits_persistent_kernel[(programs,)](
                _desc(h_CD, [cfg.block_t, cfg.block_k]), _desc(w_BD, [cfg.block_v, cfg.block_k]),
                _desc(g_CB, [cfg.block_t, cfg.block_v]), g_CB, *per_tok,
                n_c, n_v, dim, v_start, g_CB.stride(0), programs, *scalars, **flags,
                BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
                TMA_STORE=cfg.tma_store, FLATTEN=cfg.flatten,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
            return
        grid = (triton.cdiv(n_c, cfg.block_t) * triton.cdiv(n_v, cfg.block_v),)
        kernels.bwd_grad_logits_kernel[grid](
            h_CD, w_BD, g_CB, *per_tok,
            n_c, n_v, dim, v_start,
            h_CD.stride(0), h_CD.stride(1), w_BD.stride(0), w_BD.stride(1),
            g_CB.stride(0), *scalars, EVEN_K=dim % cfg.block_k == 0, **flags,
            BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    # ------------------------------------------------------------------ loss-fused forward
    def fused_loss_forward(
        self, hidden_TD, weight_VD, labels_T, token_grads, *, temperature, softcap, entropy, chunk_size,
        need_hidden, need_weight, trace=None,
    ):
        """Per-token (logprob, entropy) and, in the same pass, grad_hidden and grad_weight of a token-wise loss.

        ``token_grads(start, end, logprob_C, entropy_C)`` is called once per chunk, in order, and returns
        the loss's gradients w.r.t. the chunk's log-probs and entropies (None where the loss does not use
        them or no gradient is wanted). Per chunk of C tokens (``loss_chunk_rows``): one Triton launch
        computes the logits tile by tile, folds them into fp32 statistics and stores them as fp16 z - m;
        the caller's gradients; one memory-bound pass turns the fp16 values into 16-bit grad_logits in
        place; then grad_hidden = G @ W and grad_weight += G^T @ h (cuBLAS, rounded once per chunk).
        Without gradients the forward kernel alone runs. For layouts TMA cannot load it returns
        NotImplemented: the caller then runs the generic per-chunk forward + backward (8NHV).
        """
        kw = dict(temperature=temperature, softcap=softcap, entropy=entropy, chunk_size=chunk_size,
                  need_hidden=need_hidden, need_weight=need_weight, trace=trace)
        if not (need_hidden or need_weight):
            return self._loss_without_grads(hidden_TD, weight_VD, labels_T, token_grads, **kw)
        if not tma_compatible(hidden_TD, weight_VD):
            return NotImplemented  # the caller runs the generic per-chunk forward + backward
        n_tok, dim = hidden_TD.shape
        vocab = weight_VD.shape[0]
        rows = loss_chunk_rows(n_tok, vocab, chunk_size, self.loss_workspace_bytes)
        dev = hidden_TD.device
        shift_cols = self._shift_cols()
        z_CV = torch.empty(rows, padded_row(vocab), dtype=torch.float16, device=dev)
        g_CV = z_CV.view(hidden_TD.dtype)  # grad_logits of each element land on its own two bytes
        shift_CN = torch.empty(rows, cdiv(vocab, shift_cols), dtype=torch.float32, device=dev)
        labels_T = labels_T.contiguous()
        logprob_T = torch.empty(n_tok, dtype=torch.float32, device=dev)
        ent_T = torch.empty(n_tok, dtype=torch.float32, device=dev) if entropy else None
        grad_h = torch.empty(hidden_TD.shape, dtype=hidden_TD.dtype, device=dev) if need_hidden else None
        grad_w = torch.empty(weight_VD.shape, dtype=weight_VD.dtype, device=dev) if need_weight else None
        w_started = False  # grad_weight is written (beta=0) by the first chunk with a gradient
        for start in range(0, n_tok, rows):
            end = min(start + rows, n_tok)
            h_CD = hidden_TD[start:end]
            z = z_CV[: end - start, :vocab]
            stats = self._stats_and_shifted_logits(h_CD, weight_VD, labels_T[start:end], z, shift_CN[: end - start],
                                                   temperature, softcap, entropy, trace)
            add(trace, "logprob:triton_fused_loss")
            lse_C, logprob_T[start:end], ent_C = finish_stats(*stats)
            if ent_T is not None:
                ent_T[start:end] = ent_C
            glp_C, gent_C = token_grads(start, end, logprob_T[start:end], ent_C)
            if glp_C is None and gent_C is None:  # this chunk's loss does not depend on the logits
                if need_hidden:
                    grad_h[start:end].zero_()
                continue
            g = g_CV[: end - start, :vocab]
            self._shifted_to_grad(z, g, shift_CN, labels_T[start:end], lse_C, ent_C, glp_C, gent_C, temperature,
                                  softcap, shift_cols)
            if need_hidden:
                torch.mm(g, weight_VD, out=grad_h[start:end])
            if need_weight and w_started:
                self._accumulate_grad_weight(grad_w, g, h_CD)
            elif need_weight:
                torch.mm(g.t(), h_CD, out=grad_w)
                w_started = True
        if need_weight and not w_started:
            grad_w.zero_()
        return logprob_T, ent_T, grad_h, grad_w

    def _stats_and_shifted_logits(self, h_CD, weight_VD, labels_C, z_CV, shift_CN, temperature, softcap, entropy,
                                  trace=None):
        """One launch: the chunk's partial statistics (merged here), z - m in fp16 into ``z_CV`` and m per
        (token, vocabulary tile of ``_shift_cols`` columns) into ``shift_CN``."""
        cfg = self.loss
        (n_c, dim), vocab = h_CD.shape, weight_VD.shape[0]
        t_tiles, tiles_per_split, num_splits = forward_grid(n_c, vocab, cfg, _sm_count(h_CD), self.batch_invariant)
        m_SC = torch.empty(num_splits, n_c, dtype=torch.float32, device=h_CD.device)
        s_SC, zy_SC = torch.empty_like(m_SC), torch.empty_like(m_SC)
        a_SC = torch.empty_like(m_SC) if entropy else None
        fused_kernels.fwd_stats_store_kernel[(t_tiles * num_splits,)](
            _desc(h_CD, [cfg.block_t, cfg.block_k]), _desc(weight_VD, [cfg.block_v, cfg.block_k]),
            _desc(z_CV, [cfg.block_t, cfg.block_v]), z_CV, labels_C, m_SC, s_SC, a_SC if entropy else m_SC, zy_SC,
            shift_CN, n_c, vocab, dim, num_splits, z_CV.stride(0), shift_CN.stride(0),
            *_scalars(temperature, softcap), HAS_SOFTCAP=softcap is not None, ENTROPY=entropy,
            TILES_PER_SPLIT=tiles_per_split, BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
            GROUP=cfg.group, TMA_STORE=cfg.tma_store, FLATTEN=cfg.flatten,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return merge_partial_stats(m_SC, s_SC, a_SC, zy_SC)

    def _shift_cols(self) -> int:
        """Columns that share one stored maximum m in the loss-fused kernel (its tile width)."""
        return self.loss.block_v

    def _accumulate_grad_weight(self, grad_w_VD, g_CV, h_CD) -> None:
        """grad_weight += G^T h of one chunk (cuBLAS; fp32 inside the matmul, rounded once per chunk)."""
        grad_w_VD.addmm_(g_CV.t(), h_CD)

    def _shifted_to_grad(self, z_CV, g_CV, shift_CN, labels_C, lse_C, ent_C, glp_C, gent_C, temperature, softcap,
                         shift_cols):
        """The fp16 z - m of a chunk -> its 16-bit grad_logits ``g_CV`` (a view of the same bytes), in place;
        ``shift_cols`` columns share one m."""
        n_c, vocab = z_CV.shape
        block = 2048
        inv_temp, cap, _ = _scalars(temperature, softcap)
        fused_kernels.shifted_to_grad_kernel[(n_c, cdiv(vocab, block))](
            z_CV, g_CV, shift_CN, labels_C, lse_C,
            lse_C if gent_C is None else ent_C,
            lse_C if glp_C is None else glp_C.contiguous(),
            lse_C if gent_C is None else gent_C.contiguous(),
            vocab, z_CV.stride(0), shift_CN.stride(0), inv_temp, cap,
            HAS_SOFTCAP=softcap is not None, HAS_GLP=glp_C is not None, HAS_GENT=gent_C is not None,
            BLOCK=block, BLOCK_V=shift_cols, num_warps=4,
        )

    def _loss_without_grads(self, hidden_TD, weight_VD, labels_T, token_grads, *, temperature, softcap, entropy,
                            chunk_size, need_hidden, need_weight, trace):
        """No gradient wanted: the forward kernel over all tokens, then the loss chunk by chunk."""
        stats = self.forward_stats(hidden_TD, weight_VD, labels_T, temperature=temperature, softcap=softcap,
                                   entropy=entropy, chunk_size=None)
        _, logprob_T, ent_T = finish_stats(*stats)
        n_tok = hidden_TD.shape[0]
        rows = loss_chunk_rows(n_tok, weight_VD.shape[0], chunk_size, self.loss_workspace_bytes)
        for start in range(0, n_tok, rows):
            end = min(start + rows, n_tok)
            add(trace, "logprob:triton_fused_loss")
            token_grads(start, end, logprob_T[start:end], None if ent_T is None else ent_T[start:end])
        return logprob_T, ent_T, None, None


def _scalars(temperature: float, softcap: float | None) -> tuple[float, float, float]:
    """(1 / temperature, softcap, 1 / softcap) as the kernels take them (softcap 1 when absent)."""
    return 1.0 / temperature, softcap or 1.0, 1.0 / (softcap or 1.0)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b with fp32 accumulation and an fp32 result (cuBLAS writes its accumulator directly)."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:  # the CPU interpreter (TRITON_INTERPRET=1) and fp32 inputs
        torch.mm(a.float(), b.float(), out=out)


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for 16-bit a, b and an fp32 acc, without rounding the product to 16 bits."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # the CPU interpreter (TRITON_INTERPRET=1) and fp32 inputs
        acc.add_(torch.mm(a.float(), b.float()))


def _desc(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def _sm_count(t: torch.Tensor) -> int:
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 132
