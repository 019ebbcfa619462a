"""Causal attention over packed variable-length sequences, on the backend ``kernels.attention.backends`` chooses.

Legend: ``T`` packed tokens, ``N`` query heads, ``K`` key/value heads, ``H`` head dim.

Every backend (``fa4``, ``flash_attn``, ``torch_varlen``, ``segments``: see ``backends``) implements the same
function: causal within each segment of ``cu_seqlens``, nothing across segments, an optional sliding window where
query ``i`` sees key ``j`` iff ``0 <= i - j < window``.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actorcore.kernels.attention.backends import (BACKENDS, FLASH_DTYPES, _has_flash_attn,  # noqa: F401 (re-exported)
                                                  _has_torch_varlen, backend_refusal, choose_backend)
from actorcore.kernels.attention.fa4 import FORWARD_OP_NAME, fa4_varlen_attention
from actorcore.kernels.trace import add


def varlen_causal_attention(
    q_TNH: torch.Tensor,
    k_TKH: torch.Tensor,
    v_TKH: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    trace: Counter[str] | None = None,
) -> torch.Tensor:
    """Packed causal attention; returns ``[T, N, H]`` in the input dtype.

    ``sinks``: a learned logit per query head ``[N]`` that joins every softmax denominator and attends to
    nothing (gpt-oss); the ``segments`` and ``fa4`` backends apply it.

    ``backend``: ``"auto"`` (``backends.choose_backend``) or one of ``backends.BACKENDS``; an explicit backend that
    cannot run this call raises ``ValueError`` with the reason.

    ``trace``: counts the backend that ran under ``"varlen_attention:<backend>"`` (see ``actorcore.kernels``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    T, N, H = q_TNH.shape
    K = k_TKH.shape[1]
    if N % K:
        raise ValueError(f"{N} query heads cannot share {K} key/value heads evenly")
    if not cu_seqlens.is_cuda and int(cu_seqlens[-1]) != T:  # no device sync on the hot GPU path
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but there are {T} tokens")
    scale = H**-0.5 if scale is None else scale
    if sinks is not None and tuple(sinks.shape) != (N,):
        raise ValueError(f"sinks must hold one logit per query head, shape ({N},), got {tuple(sinks.shape)}")
    head_dim = max(H, v_TKH.shape[-1])  # the one head dim a flash kernel sees (``_with_equal_head_dims``)
    if backend == "auto":
        backend = choose_backend(q_TNH.device, q_TNH.dtype, softcap, dropout, sinks is not None, head_dim=head_dim,
                                 window=bool(sliding_window))
    else:
        why = backend_refusal(backend, q_TNH.device, q_TNH.dtype, softcap=softcap, dropout=dropout,
                              sinks=sinks is not None, window=bool(sliding_window), head_dim=head_dim)
        if why is not None:
            raise ValueError(f"attention backend {backend!r} cannot run this call: {why}")
    add(trace, f"varlen_attention:{backend}")
    if backend == "segments":
        return _segments(q_TNH, k_TKH, v_TKH, cu_seqlens, scale, sliding_window, softcap, dropout, sinks)
    if backend == "flash_attn":
        return _equal_head_dims(_flash_attn, q_TNH, k_TKH, v_TKH, cu_seqlens, max_seqlen, scale, sliding_window,
                                softcap, dropout)
    return varlen_causal_attention_traced(q_TNH, k_TKH, v_TKH, cu_seqlens, max_seqlen, scale=scale,
                                          sliding_window=sliding_window, softcap=softcap, sinks=sinks,
                                          backend=backend)


# The ops ``varlen_causal_attention_traced`` leaves in a captured graph, per backend, as the graph's node names show
# them: torch.nn.attention.varlen's custom op, and actorcore's FA4 forward op.
VARLEN_OP_NAME = "torch_attn._varlen_attn"
TRACED_OP_NAMES = {VARLEN_OP_NAME: "torch_varlen", FORWARD_OP_NAME: "fa4"}


@torch.compiler.assume_constant_result
def traceable_backend(device_type: str, dtype: torch.dtype, requested: str = "auto", head_dim: int = 0,
                      softcap: bool = False, sinks: bool = False, window: bool = False) -> str:
    """The backend of ``varlen_causal_attention_traced`` that a compiled graph can hold for attention of these
    arguments without dropout (the caller checks dropout): ``"fa4"`` or ``"torch_varlen"``, ``""`` where
    ``requested`` (``"auto"`` or a backend) comes to neither, or cannot run (the call then leaves the graph and
    raises there). A constant where Dynamo traces it: it reads only its arguments, which the tensors' guards and
    the traced code fix, and the installed packages."""
    device = torch.device(device_type)
    backend = requested
    if requested == "auto":
        backend = choose_backend(device, dtype, 1.0 if softcap else None, 0.0, sinks, head_dim=head_dim or None,
                                 window=window)
    if backend == "fa4" and backend_refusal("fa4", device, dtype, softcap=1.0 if softcap else None, sinks=sinks,
                                            window=window, head_dim=head_dim) is None:
        return backend
    if backend == "torch_varlen" and not softcap and not sinks and device.type == "cuda" and _has_torch_varlen():
        return backend
    return ""


@torch.compiler.assume_constant_result
def _gqa_kwargs_needed() -> bool:
    return _varlen_takes_enable_gqa()


def varlen_causal_attention_traced(q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor,
                                   cu_seqlens: torch.Tensor, max_seqlen: int, *, scale: float | None = None,
                                   sliding_window: int | None = None, softcap: float | None = None,
                                   sinks: torch.Tensor | None = None, backend: str = "torch_varlen") -> torch.Tensor:
    """``varlen_causal_attention`` on the ``torch_varlen`` or ``fa4`` backend, written to be traced by
    ``torch.compile`` (no host reads, no trace counting, no cached probes called inside the graph): a compiled
    decoder layer then holds its attention, and Inductor fuses the layouts and the residual stream around it.
    Callers check ``traceable_backend`` first; ``max_seqlen`` may be symbolic. ``softcap`` and ``sinks``: ``fa4``
    only."""
    H = q_TNH.shape[-1]
    scale = H**-0.5 if scale is None else scale
    if backend == "fa4":
        return _equal_head_dims(fa4_varlen_attention, q_TNH, k_TKH, v_TKH, cu_seqlens, max_seqlen, scale,
                                sliding_window, softcap, sinks)
    if backend != "torch_varlen" or softcap is not None or sinks is not None:
        raise ValueError(f"the traced attention runs torch_varlen (no softcap, no sinks) or fa4, not {backend!r}")
    return _equal_head_dims(_torch_varlen, q_TNH, k_TKH, v_TKH, cu_seqlens, max_seqlen, scale, sliding_window)


def _equal_head_dims(attend, q, k, v, *args):
    """``attend(q, k, v, *args)`` with q, k and v brought to one head dim (``_with_equal_head_dims``) where they
    differ."""
    if q.shape[-1] == v.shape[-1]:
        return attend(q, k, v, *args)
    return _with_equal_head_dims(q, k, v, lambda q_, k_, v_: attend(q_, k_, v_, *args))


def _with_equal_head_dims(q, k, v, attend):
    """Flash kernels take one head dim for q, k and v; multi-head latent attention (DeepSeek-V3, Kimi) has a value
    head dim of its own. Zero columns change no dot product and produce zero output columns, so the smaller side is
    padded and the output cut back to v's head dim (the scale was fixed from q's head dim before)."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        return attend(q, k, F.pad(v, (0, qk_dim - v_dim)))[..., :v_dim]
    return attend(F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim)), v)


def _flash_attn(q, k, v, cu, max_seqlen, scale, window, softcap, dropout):
    from flash_attn import flash_attn_varlen_func

    cu = cu.to(torch.int32)
    return flash_attn_varlen_func(
        q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scale, causal=True,
        window_size=(window - 1, 0) if window else (-1, -1), softcap=softcap or 0.0,
    )


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale, window):
    from torch.nn.attention.varlen import varlen_attn

    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] and _gqa_kwargs_needed() else {}
    window_size = (window - 1 if window else -1, 0)  # causal: a window with no right context
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=window_size, **gqa)


@functools.cache
def _varlen_takes_enable_gqa() -> bool:
    """torch 2.11's ``varlen_attn`` takes GQA directly and has no ``enable_gqa``; later versions ask for it."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _segment_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    i = torch.arange(length, device=device)
    diff = i[:, None] - i[None, :]
    allowed = diff >= 0
    if window:
        allowed &= diff < window
    return allowed


def _segments(q, k, v, cu, scale, window, softcap, dropout, sinks=None):
    """Reference-quality path: exact per-sequence attention (SDPA, or an eager softmax with softcap / sinks)."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q_NLH = q[start:end].transpose(0, 1)
        k_NLH = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        v_NLH = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        length = end - start
        needs_window = window is not None and window < length
        if softcap is None and sinks is None:
            mask = _segment_mask(length, window, q.device) if needs_window else None
            o = F.scaled_dot_product_attention(q_NLH, k_NLH, v_NLH, attn_mask=mask, is_causal=mask is None,
                                               dropout_p=dropout, scale=scale)
        else:
            scores = torch.matmul(q_NLH, k_NLH.transpose(-1, -2)) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            mask = _segment_mask(length, window, q.device)
            scores = scores.masked_fill(~mask, -math.inf)
            at_least_fp32 = torch.promote_types(scores.dtype, torch.float32)
            if sinks is not None:  # one more softmax column per head, dropped after normalising
                sink_NL1 = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, length, 1)
                probs = torch.softmax(torch.cat([scores, sink_NL1], -1), dim=-1, dtype=at_least_fp32)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1, dtype=at_least_fp32)
            probs = probs.to(q.dtype)
            if dropout:
                probs = F.dropout(probs, p=dropout)
            o = torch.matmul(probs, v_NLH)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)


@dataclass(frozen=True)
class VarlenCall:
    """One varlen flash call over gathered rows: the query rows it covers (``None``: all, in order), its segments'
    key rows (``k_index``, segment after segment), their offsets (``cu_q``, ``cu_k``) and longest lengths, and
    whether it is causal. A causal segment with more keys than queries is masked from the bottom right (query
    ``a`` of ``Lq`` sees key ``b`` of ``Lk`` iff ``b <= a + Lk - Lq``), as flash kernels do."""

    causal: bool
    q_index: torch.Tensor | None
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    def to(self, device: torch.device) -> "VarlenCall":
        move = functools.partial(torch.Tensor.to, device=device, non_blocking=True)
        q_index = None if self.q_index is None else move(self.q_index)
        return VarlenCall(self.causal, q_index, move(self.k_index), move(self.cu_q), move(self.cu_k), self.max_q,
                          self.max_k)


def _position_runs(q_bounds: list[int], k_bounds: list[int], positions: list[int],
                   sliding_window: int | None):
    """(query rows [start, stop), key rows [lo, end) of its segment) for every run of consecutive positions."""
    for qs, qe, ks, ke in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:]):
        start = qs
        while start < qe:
            stop = start + 1
            while stop < qe and positions[stop] == positions[stop - 1] + 1:
                stop += 1
            first, count = positions[start], stop - start
            end = first + count  # the run sees keys [lo, end) of its segment
            if end > ke - ks:
                raise ValueError(f"query position {end - 1} is beyond its segment's {ke - ks} keys")
            windowed = bool(sliding_window) and sliding_window < end
            lo = max(0, first - sliding_window + 1) if windowed else 0
            yield (start, stop, first), (ks + lo, ks + end), windowed
            start = stop


def prefix_plan(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, q_positions: torch.Tensor,
                sliding_window: int | None = None) -> VarlenCall:
    """``causal_attention_at_positions`` as one causal varlen call (host tensors; callers that run it every layer
    build it once and move it to the device): each run of consecutive query positions is a segment (the queries
    are in run order already: no gather) over the keys it sees, ``[lo, end)`` of its segment (a prefix, or the
    window's band), which end at the run's last position."""
    cu_q, cu_k, index = [0], [0], []
    for (start, stop, _), (lo, end), _ in _position_runs(cu_seqlens_q.tolist(), cu_seqlens_k.tolist(),
                                                         q_positions.tolist(), sliding_window):
        cu_q.append(stop)
        cu_k.append(cu_k[-1] + end - lo)
        index.append(torch.arange(lo, end))
    lengths_q = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])] or [0]
    lengths_k = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])] or [0]
    key_index = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)
    return VarlenCall(True, None, key_index, torch.tensor(cu_q, dtype=torch.int32),
                      torch.tensor(cu_k, dtype=torch.int32), max(lengths_q), max(lengths_k))


def causal_attention_at_positions(
    q_LNH: torch.Tensor,
    k_PKH: torch.Tensor,
    v_PKH: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    q_positions: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    dropout: float = 0.0,
    backend: str = "auto",
    plan: VarlenCall | None = None,
    trace: Counter[str] | None = None,
) -> torch.Tensor:
    """Causal attention of some of each segment's queries over the whole segment's keys (context parallelism:
    a rank's query chunks against the gathered keys); returns ``[L, N, H]`` in the input dtype.

    Segment ``s`` has queries ``[cu_seqlens_q[s], cu_seqlens_q[s+1])`` at positions ``q_positions`` within
    the segment and keys ``[cu_seqlens_k[s], cu_seqlens_k[s+1])`` at positions 0, 1, ...; query at position
    ``p`` sees key ``j`` iff ``j <= p`` (and ``p - j < sliding_window``). The offsets and positions are read on
    the host (CPU tensors avoid a device sync). On CUDA with 16-bit inputs and a flash kernel (``auto``), one
    varlen call covers every run of consecutive query positions (``prefix_plan``; pass ``plan`` to reuse one);
    otherwise (``segments``) each run is one SDPA call over the keys it can see: a lower-right causal bias, or
    with a sliding window a boolean mask over the window's band only.
    """
    L, N, H = q_LNH.shape
    if N % k_PKH.shape[1]:
        raise ValueError(f"{N} query heads cannot share {k_PKH.shape[1]} key/value heads evenly")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel() or q_positions.shape != (L,):
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, cu_seqlens_k {tuple(cu_seqlens_k.shape)} and "
                         f"q_positions {tuple(q_positions.shape)} do not describe the same {L} queries' segments")
    if backend not in ("auto", "segments"):
        raise ValueError(f"causal_attention_at_positions takes backend 'auto' or 'segments', got {backend!r}")
    scale = H**-0.5 if scale is None else scale
    if backend == "auto":
        backend = choose_backend(q_LNH.device, q_LNH.dtype, None, dropout, fa4=False)  # flash layouts: FA2's
    if backend != "segments":
        add(trace, f"varlen_attention:at_positions:{backend}")
        plan = (plan or prefix_plan(cu_seqlens_q, cu_seqlens_k, q_positions, sliding_window)).to(q_LNH.device)
        k_sel, v_sel = k_PKH.index_select(0, plan.k_index), v_PKH.index_select(0, plan.k_index)
        window = (sliding_window - 1 if sliding_window else -1, 0)
        if backend == "flash_attn":
            from flash_attn import flash_attn_varlen_func

            return flash_attn_varlen_func(q_LNH, k_sel, v_sel, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
                                          dropout_p=dropout, softmax_scale=scale, causal=True, window_size=window)
        from torch.nn.attention.varlen import varlen_attn

        gqa = {"enable_gqa": True} if k_sel.shape[1] != N and _varlen_takes_enable_gqa() else {}
        return varlen_attn(q_LNH, k_sel, v_sel, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale=scale,
                           window_size=window, **gqa)
    from torch.nn.attention.bias import causal_lower_right

    add(trace, "varlen_attention:at_positions")
    groups = N // k_PKH.shape[1]
    outs = []
    for (start, stop, first), (lo, end), windowed in _position_runs(cu_seqlens_q.tolist(), cu_seqlens_k.tolist(),
                                                                  q_positions.tolist(), sliding_window):
        count = stop - start
        q_NQH = q_LNH[start:stop].transpose(0, 1)
        k_NKH = k_PKH[lo:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        v_NKH = v_PKH[lo:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        if windowed:
            diff = (first + torch.arange(count, device=q_LNH.device))[:, None] - \
                (first + count - (end - lo) + torch.arange(end - lo, device=q_LNH.device))[None, :]
            mask = (diff >= 0) & (diff < sliding_window)
        else:
            mask = causal_lower_right(count, end - lo)
        o = F.scaled_dot_product_attention(q_NQH, k_NKH, v_NKH, attn_mask=mask, dropout_p=dropout, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0)
