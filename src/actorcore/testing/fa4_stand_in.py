"""A stand-in for flash-attn-4's varlen entry points on the CPU, so the FA4 backend's wiring (``kernels.attention.fa4``:
its custom ops, their autograd and fake implementations, the arguments it passes) can be tested without a Hopper GPU.

Written from flash-attn-4 4.0.0b36's interface (``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``),
not from actorcore's code: ``cu_seqlens`` int32 offsets, ``max_seqlen`` at least the longest segment, ``causal=True``
sets the right window extent to 0, a left extent ``w`` lets query ``i`` see keys ``i - w .. i`` (a left extent given
as -1 with no right extent sees nothing, as FA4 reads it), ``softcap`` caps the scaled scores as
``softcap * tanh(s / softcap)`` (0.0 or None: none), ``learnable_sink`` is one logit per query head in natural-log
units that joins every softmax denominator, query head ``h`` reads key/value head ``h // (N / K)``, the forward
returns ``(out, lse [N, T] fp32, ...)`` and the backward ``(dq, dk, dv)`` or, with a sink, ``(dq, dk, dv, dsink)``.
Every call is recorded.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from actorcore.testing.quack_stand_in import swap_attributes


def _scores_and_mask(q, k, scale, left, causal):
    """Per head ``[N, Lq, Lk]`` scaled scores of one segment (keys expanded to the query heads) and the visible
    keys."""
    s = torch.einsum("qnh,knh->nqk", q, k) * scale
    i = torch.arange(q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if causal:
        visible &= j <= i
    if left is not None:
        visible &= j >= i - left
    return s, visible


def _segment_probs(q, k, scale, softcap, left, causal, sink):
    """Per head ``[N, Lq, Lk (+1 sink column)]`` softmax probabilities of one segment, its log-sum-exp and the
    softcap's ``tanh``."""
    s, visible = _scores_and_mask(q, k, scale, left, causal)
    tanh = torch.tanh(s / softcap) if softcap else None
    if softcap:
        s = softcap * tanh
    s = s.masked_fill(~visible, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.to(s.dtype).view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]).nan_to_num(0.0), lse, tanh


def _segments_of(cu):
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def _attention(q, k, v, cu, scale, softcap, left, causal, sink):
    """``(out [T, N, H], lse [N, T])`` in the inputs' dtype (fp32 lse), segment by segment."""
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b in _segments_of(cu):
        kk, vv = (x[a:b].repeat_interleave(groups, dim=1) for x in (k, v))
        p, lse, _ = _segment_probs(q[a:b], kk, scale, softcap, left, causal, sink)
        outs.append(torch.einsum("nqk,knh->qnh", p[..., :b - a], vv))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1).float()


def _attention_backward(dout, q, k, v, out, cu, scale, softcap, left, causal, sink):
    """``(dq, dk, dv, dsink)`` of ``_attention``: dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), through the softcap's
    tanh, dQ = dS K scale, dK = dS^T Q scale (summed over each key/value head's query heads), dsink = -sum P_sink D."""
    groups = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsink = None if sink is None else torch.zeros(sink.shape, dtype=q.dtype)
    for a, b in _segments_of(cu):
        kk, vv = (x[a:b].repeat_interleave(groups, dim=1) for x in (k, v))
        p, _, tanh = _segment_probs(q[a:b], kk, scale, softcap, left, causal, sink)
        delta = (dout[a:b] * out[a:b]).sum(-1).transpose(0, 1)  # [N, Lq]
        p_keys = p[..., :b - a]
        ds = p_keys * (torch.einsum("qnh,knh->nqk", dout[a:b], vv) - delta[..., None])
        if softcap:
            ds = ds * (1 - tanh * tanh)
        dq[a:b] = torch.einsum("nqk,knh->qnh", ds, kk) * scale
        dk_heads = torch.einsum("nqk,qnh->knh", ds, q[a:b]) * scale
        dv_heads = torch.einsum("nqk,qnh->knh", p_keys, dout[a:b])
        dk[a:b] = dk_heads.unflatten(1, (k.shape[1], groups)).sum(2)
        dv[a:b] = dv_heads.unflatten(1, (k.shape[1], groups)).sum(2)
        if sink is not None:
            dsink -= (p[..., -1] * delta).sum(-1)
    return dq, dk, dv, dsink


def _window(causal, left, right):
    """FA4's reading of (causal, left, right): the left extent, or None for the whole causal prefix."""
    if left is not None and right is not None and left < 0 and right < 0:
        left = None
    return left


class FA4StandIn:
    """``_flash_attn_fwd`` / ``_flash_attn_bwd`` with FA4's argument conventions; ``calls`` records them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    @staticmethod
    def _check(q, k, v, cu_q, cu_k, max_q, max_k):
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, "cu_seqlens must be int32"
        assert q.dtype == k.dtype == v.dtype, "q, k, v must have the same dtype"
        assert q.shape[-1] == k.shape[-1], "q and k must share a head dim"
        longest = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
        assert max_q >= longest and max_k >= longest, f"max_seqlen {max_q} is below the longest segment {longest}"

    def _flash_attn_fwd(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                        causal, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
                        return_lse=False, **others):
        assert not others, f"arguments this stand-in does not model: {sorted(others)}"
        self._check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        self.calls.append(("forward", dict(causal=causal, softcap=softcap, window_size_left=window_size_left,
                                           window_size_right=window_size_right, sink=learnable_sink is not None,
                                           scale=softmax_scale, max_seqlen=max_seqlen_q)))
        left = _window(causal, window_size_left, window_size_right)
        out, lse = _attention(q, k, v, cu_seqlens_q, softmax_scale, softcap, left, causal, learnable_sink)
        return out.to(q.dtype), lse if return_lse else None, None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale, causal, softcap=0.0, *, window_size_left=None,
                        window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                        max_seqlen_k=None, learnable_sink=None, **others):
        assert not others, f"arguments this stand-in does not model: {sorted(others)}"
        self._check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        self.calls.append(("backward", dict(causal=causal, softcap=softcap, window_size_left=window_size_left,
                                            sink=learnable_sink is not None)))
        left = _window(causal, window_size_left, window_size_right)
        again, again_lse = _attention(q, k, v, cu_seqlens_q, softmax_scale, softcap, left, causal, learnable_sink)
        assert torch.allclose(again_lse, lse) and torch.allclose(again.to(out.dtype), out), \
            "the backward was handed another forward's output or log-sum-exp"
        dq, dk, dv, dsink = _attention_backward(dout, q, k, v, out, cu_seqlens_q, softmax_scale, softcap, left, causal,
                                                learnable_sink)
        return (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink.to(learnable_sink.dtype))


def use_fa4_stand_in() -> tuple[FA4StandIn, Callable[[], None]]:
    """Run the FA4 backend on the stand-in, on any device and dtype (its refusals lifted), for this process; returns
    the stand-in and the undo."""
    import actorcore.kernels.attention.backends as backends
    import actorcore.kernels.attention.fa4 as fa4

    stand_in = FA4StandIn()
    return stand_in, swap_attributes([(fa4, "_interface", lambda: stand_in),
                                      (backends, "fa4_refusal", lambda *args, **kwargs: None)])
