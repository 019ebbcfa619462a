"""A dense SwiGLU MLP with the activation inside two of its GEMMs (quack's Hopper kernels), the rest on cuBLAS.

Legend: ``T`` tokens, ``D`` features, ``I`` the MLP's intermediate width, ``O = 2I``.

Why: compiled, a decoder layer's SwiGLU MLP still makes two memory-bound passes over ``[T, I]`` values besides its
GEMMs: SwiGLU's forward (read gate and up, write the product) and its backward (read gate, up and the product's
gradient, write both gradients); on the H200 they were the largest elementwise kernels of the dense actor step.
quack computes SwiGLU from the fp32 accumulators in the gate/up GEMM's epilogue (``gemm_gated``) and SwiGLU's
backward in the epilogue of the down projection's input gradient (``gemm_dgated``); those two GEMMs are quack's, the
other four (down forward, both weight gradients, the input gradient) stay cuBLAS's, which measured faster than
quack's plain GEMMs at these shapes.

quack's gated GEMMs take gate and up interleaved column by column (``[g0, u0, g1, u1, ...]``); the
``[O, D]`` weight in that order is built per call from the two projections (``D x O`` values, a few hundredths of a
millisecond) and again in backward instead of being kept, and the weight gradient's rows are read back in that
order as the two projections' gradients.

An input that is a norm's output can be kept as the norm's input instead (``x_from``: the norm runs again in
backward; ``kernels.recomputed_input``): one ``[T, D]`` tensor less kept where the norm's input is kept anyway.

``keep_preact=False`` keeps no ``[T, O]`` pre-activation (about three quarters of what a dense layer's compiled graph
keeps): the forward's gated GEMM does not store it, and backward runs that GEMM again before its own (``2 T D O``
FLOPs, the most expensive third of the MLP's forward): a memory budget's cheaper alternative to recomputing the whole
layer. The GEMM is deterministic, so the recomputed pre-activation, and every gradient, is bitwise the kept one's.

Math: ``down @ (silu(gate @ x) * (up @ x))``: transformers' gated MLP with SiLU, no biases. SwiGLU from the fp32
accumulators (eager rounds gate and up to bf16 first): within bf16 rounding of eager, closer to fp32. CUDA on
Hopper or newer (``runtime.quack_refusal``), bf16 / fp16 only.
"""

from __future__ import annotations

import torch

from actorcore.kernels.quack import runtime
from actorcore.kernels.recomputed_input import RecomputedInput, recompute


def _interleaved(gate_ID: torch.Tensor, up_ID: torch.Tensor) -> torch.Tensor:
    """``[O, D]``: the rows of gate and up alternating (the layout quack's gated epilogues take)."""
    return torch.stack((gate_ID, up_ID), dim=1).flatten(0, 1)


class _GatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, gate_ID, up_ID, down_DI, x_from, keep_preact):
        with torch.amp.autocast("cuda", enabled=False):
            preact_TO, act_TI = _gate_up(x_TD, _interleaved(gate_ID, up_ID), store_preact=keep_preact)
            out_TD = act_TI @ down_DI.T
        kept = (preact_TO,) if keep_preact else ()
        ctx.save_for_backward(x_TD if x_from is None else x_from.source, gate_ID, up_ID, down_DI, *kept)
        ctx.x_fn, ctx.x_shape = (None if x_from is None else x_from.fn), x_TD.shape
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, gate_ID, up_ID, down_DI, *kept = ctx.saved_tensors
        if ctx.x_fn is not None:  # kept as the norm's input: the norm again (kernels.recomputed_input)
            x_TD = recompute(ctx.x_fn, x_TD).reshape(ctx.x_shape)
        q = runtime.gemm_interface()
        pairs_OD = _interleaved(gate_ID, up_ID)
        with torch.amp.autocast("cuda", enabled=False):
            preact_TO = kept[0] if kept else _gate_up(x_TD, pairs_OD, store_preact=True)[0]
            # the down projection's input gradient with SwiGLU's backward in its epilogue (and SwiGLU recomputed)
            grad_preact_TO, act_TI = q.gemm_dgated(grad_out_TD.contiguous(), down_DI, preact_TO, activation="swiglu",
                                                   tuned=False)
            grad_down_DI = grad_out_TD.T @ act_TI
            grad_x_TD = grad_preact_TO @ pairs_OD
            grad_pairs = (grad_preact_TO.T @ x_TD).unflatten(0, (-1, 2))  # [I, 2, D]: gate's and up's rows
        return grad_x_TD, grad_pairs[:, 0], grad_pairs[:, 1], grad_down_DI, None, None


def _gate_up(x_TD: torch.Tensor, pairs_OD: torch.Tensor, store_preact: bool) -> tuple:
    """``(the [T, O] pre-activation or None, SwiGLU's [T, I] output)``: the gate/up GEMM over the interleaved weight
    with SwiGLU in its epilogue (the same call in forward and in a recompute: bitwise the same pre-activation)."""
    return runtime.gemm_interface().gemm_gated(x_TD, pairs_OD.T, activation="swiglu", store_preact=store_preact,
                                               tuned=False)


def gated_mlp(x_TD: torch.Tensor, gate_ID: torch.Tensor, up_ID: torch.Tensor, down_DI: torch.Tensor,
              x_from: RecomputedInput | None = None, keep_preact: bool = True) -> torch.Tensor:
    """``[T, D]``: ``down(silu(gate(x)) * up(x))`` with SwiGLU inside quack's GEMMs (weights as ``nn.Linear``
    stores them: ``[out, in]``). ``x_from``: ``x`` is ``x_from.fn(x_from.source)`` (its values, in any shape with
    ``T * D`` elements); backward keeps the source and recomputes ``x``. ``keep_preact=False``: backward runs the
    gate/up GEMM again instead of keeping its ``[T, 2I]`` output."""
    weights = (gate_ID, up_ID, down_DI)
    if x_TD.dtype not in (torch.bfloat16, torch.float16) or any(w.dtype != x_TD.dtype for w in weights):
        raise ValueError(f"quack's gated MLP takes bf16 / fp16 inputs and weights of one dtype, got {x_TD.dtype} "
                         f"and weights {', '.join(str(w.dtype) for w in weights)}")
    if x_TD.dim() != 2:
        raise ValueError(f"quack's gated MLP takes [tokens, features] inputs, got shape {tuple(x_TD.shape)}")
    if x_from is not None and not x_TD.is_contiguous():
        raise ValueError("gated_mlp(x_from=...) takes a contiguous x: the recomputed x must be its layout")
    return _GatedMLP.apply(x_TD.contiguous(), gate_ID, up_ID, down_DI, x_from, keep_preact)
