"""A stand-in for quack's GEMMs on the CPU, so the arithmetic around them (``kernels.quack.gated_mlp``,
``kernels.quack.moe``, the Megatron route's quack experts) can be tested without a Hopper GPU.

Written from quack's documented semantics (``quack.gemm_interface``'s reference implementations and argument
comments), not from actorcore's code: a concatenated ``[gate; up]`` operand is read with gate and up interleaved
entry by entry along its non-contiguous dim, the gated activation's columns come interleaved ``[g0, u0, g1, ...]``,
``A_idx`` gathers ``A``'s rows (variable-length M) or columns (variable-length K), ``cu_seqlens_m`` / ``cu_seqlens_k``
give each expert's rows, a concat ``"out"`` is written ``[gate; up]`` along the output's non-contiguous dim, and the
dgated epilogue scales the accumulator by ``colvec_scale`` and reduces ``sum(act * acc)`` per row.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def _noncontiguous_dim(t: torch.Tensor) -> int:
    return -2 if t.stride(-1) == 1 else -1


def _interleaved(t: torch.Tensor) -> torch.Tensor:
    """``[first; second]`` along the non-contiguous dim, as alternating entries."""
    dim = _noncontiguous_dim(t)
    return t.unflatten(dim, (2, t.shape[dim] // 2)).transpose(dim - 1, dim).flatten(dim - 1, dim)


def _segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


def _rows(A, B, cu_seqlens_m, A_idx):
    """``A @ B``, per expert for variable-length M (``A``'s rows gathered by ``A_idx``)."""
    if cu_seqlens_m is None:
        return A @ B
    return torch.cat([(A[A_idx[a:b]] if A_idx is not None else A[a:b]) @ B[e]
                      for e, (a, b) in enumerate(_segments(cu_seqlens_m))])


def _swiglu_backward(grad_act, gate, up):
    sig = torch.sigmoid(gate)
    grad_gate = grad_act * up * sig * (1 + gate * (1 - sig))
    return torch.stack([grad_gate, grad_act * gate * sig], dim=-1).flatten(-2), gate * sig * up


class QuackStandIn:
    """``gemm``, ``gemm_gated`` and ``gemm_dgated`` (SwiGLU) as quack documents them, in plain torch."""

    @staticmethod
    def gemm(A, B, out=None, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None, concat_layout=None, tuned=True):
        concat_layout = concat_layout or ()
        if "B" in concat_layout:
            B = _interleaved(B)
        if cu_seqlens_k is None:
            result = _rows(A, B, cu_seqlens_m, A_idx)
        else:
            result = torch.stack([(A[:, A_idx[a:b]] if A_idx is not None else A[:, a:b]) @ B[a:b]
                                  for a, b in _segments(cu_seqlens_k)])
        if "out" in concat_layout:
            dim = _noncontiguous_dim(out) if out is not None else -2
            halves = (result[..., ::2, :], result[..., 1::2, :]) if dim == -2 else (result[..., ::2], result[..., 1::2])
            result = torch.cat(halves, dim=dim)
        if out is None:
            return result
        out.copy_(result)
        return out

    @staticmethod
    def gemm_gated(A, B, activation, cu_seqlens_m=None, A_idx=None, concat_layout=None, store_preact=True, tuned=True):
        assert activation == "swiglu"
        preact = _rows(A, _interleaved(B) if concat_layout == ("B",) else B, cu_seqlens_m, A_idx)
        return preact if store_preact else None, F.silu(preact[..., ::2]) * preact[..., 1::2]

    @staticmethod
    def gemm_dgated(A, B, PreAct, activation, colvec_scale=None, colvec_reduce=False, cu_seqlens_m=None, A_idx=None,
                    tuned=True):
        assert activation == "swiglu"
        acc = _rows(A, B, cu_seqlens_m, A_idx)
        wide = torch.promote_types(acc.dtype, torch.float32)  # fp32 (or wider) accumulators; outputs in PreAct's dtype
        acc = acc.to(wide)
        scale = colvec_scale[:, None] if colvec_scale is not None else 1.0
        grad_preact, act = _swiglu_backward(acc * scale, PreAct[..., ::2].to(wide), PreAct[..., 1::2].to(wide))
        out = (grad_preact.to(PreAct.dtype), (act * scale).to(PreAct.dtype))
        return out if not colvec_reduce else (*out, (act * acc).sum(-1))


def use_quack_stand_in() -> Callable[[], None]:
    """Run actorcore's quack paths (both routes) on the stand-in, in any dtype and on any device (quack's one
    availability probe, its entry point, and the gated MLP's and the MoE experts' CUDA checks lifted), for this
    process; returns the undo."""
    import actorcore.hf.features.moe_experts as moe_experts
    import actorcore.hf.features.swiglu_mlp as swiglu_mlp
    import actorcore.kernels.quack.gated_mlp as quack_gated_mlp
    import actorcore.kernels.quack.runtime as quack_runtime

    return swap_attributes([(quack_runtime, "gemm_interface", lambda: QuackStandIn),
                            (quack_runtime, "quack_refusal", lambda: None),
                            (swiglu_mlp, "_device_refusal", lambda module: None),
                            (moe_experts, "_device_refusal", lambda module: None),
                            (swiglu_mlp, "gated_mlp",
                             lambda x, g, u, d, x_from=None, keep_preact=True:
                             quack_gated_mlp._GatedMLP.apply(x, g, u, d, x_from, keep_preact))])


def swap_attributes(replaced: list[tuple[object, str, object]]) -> Callable[[], None]:
    """Set each ``(module, name, value)``; returns the undo that puts the originals back."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in replaced]
    for module, name, value in replaced:
        setattr(module, name, value)

    def undo() -> None:
        for module, name, value in originals:
            setattr(module, name, value)

    return undo
