"""An op's input kept as the tensor it was computed from, and recomputed in backward.

Why: a GEMM keeps its input for the weight gradient. Where that input is a norm's output, the norm's input is kept
anyway (for the norm's own backward), so keeping both holds one hidden-sized tensor per token more than needed; a
fused graph (the HF route's compiled layer) recomputes the norm in backward instead. ``RecomputedInput`` lets an
eager op (Megatron's projection, quack's gated MLP) do the same: it names the source and the function that made the
input from it, and ``recompute`` runs that function again on the source in backward.

Bitwise: ``recompute`` calls the function with gradients enabled on a source of the same ``requires_grad``, so a
compiled function runs the graph it ran in the forward (the same kernels), and the input is the forward's bit for
bit where those kernels are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class RecomputedInput:
    """An op's input ``fn(source)``: kept as ``source``, recomputed by ``fn`` in backward."""

    source: torch.Tensor
    fn: Callable[[torch.Tensor], torch.Tensor]


def recompute(fn: Callable[..., Any], *sources: torch.Tensor) -> Any:
    """``fn(*sources)`` again, detached (a tensor or a tuple of them), through the graph the forward ran (see the
    module's docstring)."""
    with torch.enable_grad():
        out = fn(*(s.detach().requires_grad_(s.requires_grad) for s in sources))
    return tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()
