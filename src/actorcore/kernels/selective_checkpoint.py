"""Selective activation checkpointing: keep what is expensive to recompute, recompute what is cheap.

Why: full layer checkpointing runs every decoder layer's forward twice (about a quarter of an actor step on
the H200); without checkpointing the step needs every activation at once (88 GiB at 31K tokens of a 1.5B
model). A selective checkpoint keeps the outputs of the matmuls and attention kernels (the FLOPs) and
recomputes the pointwise ops and norms in backward (the bytes), using PyTorch's own policy mechanism
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``). The recomputed ops see the same inputs
(kept outputs are reused as they were), so the gradients are bitwise those of full checkpointing wherever
the recomputed kernels are deterministic.

``layers_to_keep`` is the pure budget planner: how many layers may keep their activations (selective or not
checkpointed at all) in a given memory budget, the others stay fully checkpointed.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

SELECTIVE_TRACE_KEY = "checkpoint:selective"  # selective checkpoint contexts created (one per checkpointed forward)

_MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm")
# Attention kernels, by the name of their op: torch's varlen and SDPA flash / efficient / cuDNN kernels, flash-attn,
# actorcore's FA4 op (``kernels.attention.fa4``).
_ATTENTION_NAMES = ("varlen_attn", "flash_attention", "efficient_attention", "cudnn_attention", "flash_attn",
                    "_scaled_dot_product", "fa4_varlen_forward")


def _ops(names: Sequence[str]) -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


@functools.cache
def _kept_ops() -> frozenset:
    return _ops(_MATMUL_OPS)


def is_expensive(op: Any) -> bool:
    """A matmul or an attention kernel: its output is kept instead of recomputed."""
    if op in _kept_ops():
        return True
    name = str(op)
    return any(key in name for key in _ATTENTION_NAMES) and "backward" not in name


# Grouped / batched GEMMs: what an MoE layer's experts run. Code that adds a bias in place into their output (a kept
# output must not change after it was kept) has them recomputed instead (``SelectiveContexts(recompute=...)``).
GROUPED_GEMM_OPS = ("_grouped_mm", "bmm", "baddbmm")


def keep_expensive_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: matmul and attention outputs saved, everything else recomputed."""
    return CheckpointPolicy.MUST_SAVE if is_expensive(op) else CheckpointPolicy.PREFER_RECOMPUTE


class KeepExpensiveExcept:
    """``keep_expensive_policy`` with some ops recomputed although expensive (an object, so a checkpoint's
    context function holds no closure)."""

    def __init__(self, recompute: frozenset) -> None:
        self.recompute = recompute

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in self.recompute:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return keep_expensive_policy(ctx, op, *args, **kwargs)


class SelectiveContexts:
    """``context_fn`` of a selective checkpoint; counts in the call's trace each time it is used (forward and
    recompute), which is how a call proves the selective checkpoint ran. ``recompute``: names of expensive aten
    ops whose outputs this layer recomputes instead of keeping (its code writes into them in place)."""

    def __init__(self, trace: Counter | None, recompute: Sequence[str] = ()) -> None:
        self.trace = trace
        self.policy = KeepExpensiveExcept(_ops(recompute)) if recompute else keep_expensive_policy

    def __call__(self) -> Any:
        if self.trace is not None:
            self.trace[SELECTIVE_TRACE_KEY] += 1
        return create_selective_checkpoint_contexts(self.policy)


def selective_checkpoint_function(trace: Counter | None = None, recompute: Sequence[str] = ()) -> Callable:
    """A drop-in for a layer's checkpoint function (``checkpoint(fn, *args)``), non-reentrant and selective;
    ``recompute``: expensive ops (aten names) recomputed rather than kept in this layer."""
    return functools.partial(checkpoint, use_reentrant=False, context_fn=SelectiveContexts(trace, recompute))


def layers_to_keep(budget_bytes: float, base_bytes: float, kept_layer_bytes: Sequence[float]) -> int:
    """How many of the last layers may keep their activations within ``budget_bytes`` above ``base_bytes``
    (weights, gradients, the checkpointed inputs, slack); ``kept_layer_bytes[i]``: what layer ``i`` keeps beyond a
    checkpointed layer. Backward runs the kept layers first, the last first, freeing each: at kept layer j the kept
    layers up to j are alive, with j's gradients on top (about j's bytes again); a checkpointed layer then needs
    3 of its bytes (its recompute, its gradients) after the kept ones are gone, so the two peaks do not add. With
    equal layers: k kept cost k + 1 layers, up to two kept layers nothing over full checkpointing; where not even
    that fits, none is kept, and a warning says the budget cannot be met (once per budget: Python's registry)."""
    room = budget_bytes - base_bytes
    if max(kept_layer_bytes, default=0.0) <= 0:
        return len(kept_layer_bytes)
    if room < 3 * max(kept_layer_bytes):
        warnings.warn(f"a memory budget of {budget_bytes / 2**30:g} GiB cannot be met here: the weights, gradients "
                      "and the layers' checkpointed inputs leave no room for one layer's recompute, so every layer "
                      "is fully recomputed and the peak goes over the budget; raise the budget, or spread the model "
                      "(FSDP2, activation offload, sequence parallelism)", UserWarning, stacklevel=2)
        return 0
    keep, peak = 0, 0.0
    for layer_bytes in reversed(kept_layer_bytes):
        # One more kept layer in front: it is alive at every kept layer after it, and its own peak is its bytes
        # and its gradients.
        peak = max(peak + layer_bytes, 2 * layer_bytes)
        if peak > room:
            break
        keep += 1
    return keep
