"""A compiled Megatron layer's GEMMs keeping their norm's input, not the norm's output, for backward.

Why: Megatron's ``ColumnParallelLinear`` keeps its input for the weight gradient. ``linear_qkv``'s input is the
input norm's output, a hidden-sized tensor kept only for that, while the norm's input (the layer's input) is kept
anyway for the norm's own backward. The HF route's compiled layer recomputes the norm in backward instead. Found by
listing the saved tensors of both routes' layers (Inductor's C++ kernels on a tiny MoE): the Megatron layer kept
this one hidden-sized tensor more, 2 x hidden bytes per token per layer (4 KB on the Qwen3-30B-A3B shape, about
1 GB over its 8 layers at 32K tokens).

Here the layer lends the module its input's source for one call (``LentNormInput.normed_from``); the module then
keeps the source and recomputes the norm in backward with the same compiled function (``kernels.recomputed_input``),
so the recomputed input is bitwise the one the forward used and the gradients are bitwise those of keeping it
(the same GEMMs on the same tensors). Modules: the QKV projection and a dense MLP's fc1 (``NormRecomputingLinear``,
Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` at one TP rank), quack's dense MLP
(``kernels.quack.gated_mlp``), and an MoE layer with its experts local (``gather_dispatch.GatherMoELayer``: the router
as ``NormRecomputingRouter``, megatron-core's ``RouterGatingLinearFunction`` without Transformer Engine, and quack's
local experts, ``kernels.quack.moe.gated_experts``). On the CPU analog of the Qwen3-30B-A3B layer (both routes'
saved tensors, Inductor's C++ kernels) the Megatron layer then keeps less than the HF route's, which keeps the
pre-MLP norm's output for its router.

Where (``normed_projection_refusal``, ``router_refusal``, ``GatherMoELayer``): megatron-core's own
``ColumnParallelLinear`` / ``TopKRouter`` at one TP rank, no fused weight-gradient accumulation, no fp8, no
Transformer Engine GEMM, a trainable weight, no shared experts, in the compiled layers. A call whose input is not
the lent norm output (another view, a copy, a jittered input, written to since) runs Megatron's code. Each
recomputing call counts in the module's ``recomputing_calls``; the layer turns that into the trace key
``RECOMPUTED_NORM_KEY``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from actorcore.kernels.recomputed_input import RecomputedInput, recompute

try:  # megatron-core is optional; this module is only imported after require_megatron()
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, custom_bwd, custom_fwd
    from megatron.core.transformer.moe.router import TopKRouter
except ImportError:  # pragma: no cover - guarded by require_megatron
    ColumnParallelLinear = TopKRouter = torch.nn.Module  # type: ignore[misc,assignment]
    custom_fwd = custom_bwd = lambda fn: fn  # noqa: E731

RECOMPUTED_NORM_KEY = "mcore:recomputed_norm_input"  # norm outputs a projection recomputed in backward, not kept


def normed_projection_refusal(linear: Any, config: Any) -> str | None:
    """Why this projection keeps its own input (None: ``NormRecomputingLinear`` can keep the norm's input)."""
    checks = (
        (type(linear) in (ColumnParallelLinear, NormRecomputingLinear), "a projection other than megatron-core's "
                                                                         "ColumnParallelLinear"),
        (config.tensor_model_parallel_size == 1 and not config.sequence_parallel, "tensor parallelism"),
        (not config.gradient_accumulation_fusion, "gradient_accumulation_fusion (weight gradients into main_grad)"),
        (not (config.fp8 or config.fp4), "fp8 / fp4 layers"),
        (getattr(linear, "weight", None) is not None, "a weight passed at call time"),
    )
    return next((what for ok, what in checks if not ok), None)


class LentNormInput:
    """A module the layer can lend, for one call, the norm output it hands the module with that output's source
    (``normed_from``); ``lent_origin`` says whether an input is that output, unchanged (then the module keeps the
    source and recomputes the norm in backward)."""

    __slots__ = ()  # a mixin after the Megatron base: a class swap onto that module keeps its layout
    recomputing_calls = 0

    @contextlib.contextmanager
    def normed_from(self, normed: torch.Tensor, origin: RecomputedInput) -> Iterator[None]:
        """Within the block, an input that is ``normed`` (``origin.fn(origin.source)``) is recomputed from the
        source in backward rather than kept."""
        self.__dict__["_lent"] = (normed, normed._version, origin)  # not a submodule attribute: the layer owns it
        try:
            yield
        finally:
            self.__dict__.pop("_lent", None)

    def lent_origin(self, input: torch.Tensor) -> RecomputedInput | None:
        """The lent norm output's origin where ``input`` is that output and gradients are on (None: keep ``input``)."""
        lent = self.__dict__.get("_lent")
        if lent is None or not torch.is_grad_enabled() or not _same_values(input, lent[0], lent[1]):
            return None
        return lent[2]


class NormRecomputingLinear(ColumnParallelLinear, LentNormInput):
    """``ColumnParallelLinear`` that, for a call lent a norm output with its source (``normed_from``), keeps the
    source and recomputes the norm in backward (the same module, parameters and state dict)."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      gradient_accumulation_fusion: bool = False, allreduce_dgrad: bool = False,
                      sequence_parallel: bool = False, *args: Any, **kwargs: Any) -> torch.Tensor:
        origin = self.lent_origin(input)
        if origin is None or gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel \
                or not weight.requires_grad:
            return super()._forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                         sequence_parallel, *args, **kwargs)
        self.recomputing_calls += 1
        return _ProjectRecomputedInput.apply(input, origin, weight, bias)


def _same_values(a: torch.Tensor, lent: torch.Tensor, lent_version: int) -> bool:
    """``a`` shows the lent tensor's values as lent: the same memory, shape, strides and dtype (an alias Megatron's
    TP-region copy makes at one rank), not written to since."""
    return a.data_ptr() == lent.data_ptr() and a.shape == lent.shape and a.stride() == lent.stride() \
        and a.dtype == lent.dtype and a._version == lent_version


class _ProjectRecomputedInput(torch.autograd.Function):
    """``input @ weight.T + bias`` keeping ``origin.source`` instead of ``input``; backward is Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication.backward`` at one TP rank on the recomputed input."""

    @staticmethod
    @custom_fwd
    def forward(ctx: Any, input: torch.Tensor, origin: RecomputedInput, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(origin.source, weight)
        ctx.fn, ctx.use_bias = origin.fn, bias is not None
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    @custom_bwd
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        source, weight = ctx.saved_tensors
        input = recompute(ctx.fn, source)
        grad_input = grad_output.matmul(weight)
        grad_2d = grad_output.contiguous().view(-1, grad_output.shape[-1])
        input_2d = input.contiguous().view(-1, input.shape[-1])
        grad_weight = grad_2d.t().matmul(input_2d)
        grad_bias = grad_2d.sum(dim=0) if ctx.use_bias else None
        return grad_input, None, grad_weight, grad_bias


def use_norm_recomputing_projection(linear: Any, config: Any) -> bool:
    """Make ``linear`` a ``NormRecomputingLinear`` where ``normed_projection_refusal`` passes; whether it is one."""
    if normed_projection_refusal(linear, config) is not None:
        return False
    linear.__class__ = NormRecomputingLinear
    return True


class NormRecomputingRouter(TopKRouter, LentNormInput):
    """Megatron's ``TopKRouter`` whose gating GEMM, for a call lent a norm output with its source, keeps the source
    and recomputes the norm in backward (the same module, parameters and state dict)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        origin = self.lent_origin(input)
        if origin is None or not self.weight.requires_grad or self.weight.device != input.device:
            return super().gating(input)
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        self.recomputing_calls += 1
        return _GateRecomputedInput.apply(input, origin, self.weight, self.bias, router_dtype)


class _GateRecomputedInput(torch.autograd.Function):
    """megatron-core's ``RouterGatingLinearFunction`` (its path without Transformer Engine) keeping
    ``origin.source`` instead of the input."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, origin: RecomputedInput, weight: torch.Tensor,
                bias: torch.Tensor | None, router_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(origin.source, weight, bias)
        ctx.fn, ctx.router_dtype, ctx.input_dtype, ctx.weight_dtype = origin.fn, router_dtype, input.dtype, weight.dtype
        ctx.input_shape = input.shape
        input_2d = input.view(-1, input.shape[-1]).to(router_dtype)
        if bias is None:
            output = torch.mm(input_2d, weight.to(router_dtype).t())
        else:
            output = torch.addmm(bias.to(router_dtype), input_2d, weight.to(router_dtype).t())
        return output.view(*input.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        source, weight, bias = ctx.saved_tensors
        input_2d = recompute(ctx.fn, source).reshape(-1, ctx.input_shape[-1])
        grad_output = grad_output.view(-1, grad_output.shape[-1])
        grad_input = torch.mm(grad_output, weight.to(ctx.router_dtype)).to(ctx.input_dtype)
        grad_weight = torch.mm(grad_output.t(), input_2d.to(ctx.router_dtype)).to(ctx.weight_dtype)
        grad_bias = grad_output.sum(dim=0).to(ctx.weight_dtype) if bias is not None else None
        return grad_input.view(ctx.input_shape), None, grad_weight, grad_bias, None


def router_refusal(router: Any) -> str | None:
    """Why this router keeps its input (None: ``NormRecomputingRouter`` can keep the norm's input instead)."""
    from megatron.core.transformer.moe import moe_utils

    checks = (
        (type(router) in (TopKRouter, NormRecomputingRouter), "a router other than megatron-core's TopKRouter"),
        (getattr(moe_utils, "te_general_gemm", None) is None, "Transformer Engine's router GEMM"),
        (getattr(router, "weight", None) is not None, "a router without its own weight"),
    )
    return next((what for ok, what in checks if not ok), None)


def use_norm_recomputing_router(router: Any) -> bool:
    """Make ``router`` a ``NormRecomputingRouter`` where ``router_refusal`` passes; whether it is one."""
    if router_refusal(router) is not None:
        return False
    router.__class__ = NormRecomputingRouter
    return True
