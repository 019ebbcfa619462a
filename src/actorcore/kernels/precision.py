"""Autocast-free numerics: the kernels' promised fp32, whatever autocast region the caller is in.

Why: inside ``torch.autocast(..., torch.bfloat16)`` a plain ``h @ w.T`` returns bf16 logits, and an in-place
op mixing them with fp32 buffers fails. The head promises fp32 logits, so every kernel entry point runs with
autocast off for the inputs' device type, in forward and in backward: autograd runs a backward under the
autocast state of the thread that calls ``.backward()``, which may be inside the caller's region too.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Sequence

import torch


def autocast_disabled(device: torch.device) -> ContextManager[None]:
    """A context in which autocast is off for ``device``'s type (a no-op where that type has no autocast)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def without_autocast(fn: Callable[..., Sequence[torch.Tensor | None]], *inputs: torch.Tensor):
    """``fn(*inputs)`` (a tuple of tensors or None) with autocast off in its forward and its backward.

    For plain-autograd code (the reference head, the value head): built-in ops' backward would otherwise run
    under the caller's autocast state. ``fn``'s graph is kept from the forward, not recomputed.
    """
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs)):
        with autocast_disabled(inputs[0].device):
            return tuple(fn(*inputs))
    return _WithoutAutocast.apply(fn, *inputs)


class _WithoutAutocast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        leaves = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        with torch.enable_grad(), autocast_disabled(inputs[0].device):
            outputs = tuple(fn(*leaves))
        ctx.set_materialize_grads(False)
        ctx.graph = (leaves, outputs)
        return tuple(None if o is None else o.detach() for o in outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        leaves, outputs = ctx.graph
        ctx.graph = None
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o is not None and g is not None and o.requires_grad]
        wanted = [x for x in leaves if x.requires_grad]
        grads = iter([None] * len(wanted))
        if pairs and wanted:
            with autocast_disabled(leaves[0].device):
                grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                                 allow_unused=True))
        return (None, *(next(grads) if x.requires_grad else None for x in leaves))


def value_head(hidden_TD: torch.Tensor, weight_1D: torch.Tensor, bias_1: torch.Tensor | None = None) -> torch.Tensor:
    """A critic's 1-output linear head ``[T]`` in float32, with autocast off in its forward and its backward (both
    routes' critics: fp32 values as promised, also inside a caller's autocast region)."""
    params = (weight_1D,) if bias_1 is None else (weight_1D, bias_1)
    return without_autocast(_fp32_values, hidden_TD, *params)[0]


def _fp32_values(hidden_TD: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    values_T1 = torch.nn.functional.linear(hidden_TD.float(), weight.float(), None if bias is None else bias.float())
    return (values_T1[:, 0],)
