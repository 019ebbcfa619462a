"""Selective activation checkpointing: keep what is expensive to recompute, recompute what is cheap.

Why: full layer checkpointing runs every decoder layer's forward twice (about a quarter of an actor step on
the H200); without checkpointing the step needs every activation at once (88 GiB at 31K tokens of a 1.5B
model). A selective checkpoint keeps the outputs of the matmuls and attention kernels (the FLOPs) and
recomputes the pointwise ops and norms in backward (the bytes), using PyTorch's own policy mechanism
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``). The recomputed ops see the same inputs
(kept outputs are reused as they were), so the gradients are bitwise those of full checkpointing wherever
the recomputed kernels are deterministic.

``cheapest_plan`` is the pure budget planner: which layers may keep their activations (selective or not
checkpointed at all), which keep part of them and redo the rest, and which stay fully checkpointed, in a given
memory budget, redoing the least work; ``layers_to_keep`` its kept-or-full case.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

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


@dataclass(frozen=True)
class KeptLayer:
    """One way a layer keeps activations under a memory budget (bytes for the call): what it keeps beyond a fully
    checkpointed layer; its own peak in backward on top of that (its gradients, about its kept bytes again, and what
    its backward makes again); the work (any unit, the same for every layer) its backward redoes."""

    kept: float
    backward: float
    recompute: float = 0.0


def cheapest_plan(budget_bytes: float, base_bytes: float, full_cost: Sequence[float], kept: Sequence[KeptLayer],
                  partial: Sequence[KeptLayer | None] | None = None, tail_bytes: float = 0.0,
                  grads_from: Sequence[float] | None = None, recompute_bytes: float | None = None) -> list[str]:
    """Each layer's way, ``"full"``, ``"partial"`` or ``"kept"``, that redoes the least work in backward while the
    backward peak stays within ``budget_bytes`` above ``base_bytes`` (weights, gradients, the checkpointed inputs,
    slack). ``full_cost[i]``: the work of layer ``i``'s forward (what full checkpointing redoes); ``kept[i]``: the layer
    keeping its activations; ``partial[i]``: a way that keeps less and redoes part of the forward (None: none).
    ``tail_bytes``: what is alive beside every kept layer after the last layer and before its backward (the LM head's
    weight gradient), gone before it. ``grads_from[i]``: weight gradients not allocated when the call plans that
    exist by layer ``i``'s backward (``gradients_by_layer``: a step's first micro-batch). ``recompute_bytes``: what
    a fully checkpointed layer's backward needs once the others are gone (default: 3 of the largest kept bytes, its
    recompute and gradients), beside every gradient to come.

    The plan is full layers first, then partial ones, then kept ones: backward runs the last layer first, freeing each
    layer after it; at layer j the kept and partial layers up to j are alive with j's own backward peak on top, so
    the layers with the larger backward peak go in front. A fully checkpointed layer needs 3 of its kept bytes (its
    recompute, its gradients) after the others are gone, so the peaks do not add. Where not even that fits, every
    layer is fully checkpointed and a warning says the budget cannot be met (once per budget: Python's registry)."""
    layers = len(kept)
    partial = partial if partial is not None else [None] * layers
    grads = list(grads_from) if grads_from else [0.0] * layers
    kept = [replace(k, backward=k.backward + g) for k, g in zip(kept, grads)]
    partial = [None if p is None else replace(p, backward=p.backward + g) for p, g in zip(partial, grads)]
    room, largest = budget_bytes - base_bytes, max((k.kept for k in kept), default=0.0)
    recompute = 3 * largest if recompute_bytes is None else recompute_bytes
    if largest <= 0:  # keeping costs nothing
        room = max(room, 0.0)
    elif room < recompute + (grads[0] if grads else 0.0):
        warnings.warn(f"a memory budget of {budget_bytes / 2**30:g} GiB cannot be met here: the weights, gradients "
                      "and the layers' checkpointed inputs leave no room for one layer's recompute, so every layer "
                      "is fully recomputed and the peak goes over the budget; raise the budget, pass fewer tokens "
                      "per call (the checkpointed inputs and a layer's recompute scale with them), or spread the "
                      "model (FSDP2, activation offload, sequence parallelism)", UserWarning, stacklevel=3)
        return ["full"] * layers
    best_cost, best = float(sum(full_cost)), (0, 0)
    kept_peak = tail_bytes
    for n_kept in range(layers + 1):
        if n_kept:
            layer = kept[layers - n_kept]
            kept_peak = _with_one_more(kept_peak, layer)
            if kept_peak > room:
                break
        peak, cost = kept_peak, float(sum(full_cost[:layers - n_kept]))
        if cost < best_cost:
            best_cost, best = cost, (n_kept, 0)
        for n_partial in range(1, layers - n_kept + 1):
            index = layers - n_kept - n_partial
            layer = partial[index] or kept[index]
            peak = _with_one_more(peak, layer)
            if peak > room:
                break
            cost += layer.recompute - full_cost[index]
            if cost < best_cost:
                best_cost, best = cost, (n_kept, n_partial)
    n_kept, n_partial = best
    first_kept = layers - n_kept
    return (["full"] * (first_kept - n_partial)
            + ["partial" if partial[i] is not None else "kept" for i in range(first_kept - n_partial, first_kept)]
            + ["kept"] * n_kept)


def _with_one_more(peak: float, layer: KeptLayer) -> float:
    """The backward peak with one more layer in front: it is alive at every layer after it, and its own peak is what
    it keeps and its backward's."""
    return max(peak + layer.kept, layer.kept + layer.backward)


def layers_to_keep(budget_bytes: float, base_bytes: float, kept_layer_bytes: Sequence[float],
                   grads_from: Sequence[float] | None = None) -> int:
    """How many of the last layers may keep their activations within ``budget_bytes`` above ``base_bytes``
    (``cheapest_plan`` with kept or fully checkpointed layers only; ``kept_layer_bytes[i]``: what layer ``i`` keeps
    beyond a checkpointed layer, its gradients about as much again; ``grads_from``: ``cheapest_plan``'s). With equal
    layers: k kept cost k + 1 layers, up to two kept layers nothing over full checkpointing; where not even that
    fits, none."""
    kept = [KeptLayer(b, b) for b in kept_layer_bytes]
    return cheapest_plan(budget_bytes, base_bytes, [1.0] * len(kept), kept, grads_from=grads_from).count("kept")


def unallocated_gradient_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients a backward allocates anew for ``params``: trainable ones with neither a ``grad`` nor
    a Megatron ``main_grad`` buffer yet, at their dtype; this rank's shard of an FSDP2 (DTensor) parameter."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in params
               if p.requires_grad and p.grad is None and getattr(p, "main_grad", None) is None)


def gradients_by_layer(own: Sequence[float], rest: float) -> list[float]:
    """``cheapest_plan``'s ``grads_from``: at layer ``i``'s backward, its own gradients to come (``own[i]``), the later
    layers' and ``rest`` (the head's, there from the start of backward)."""
    after, out = float(rest), []
    for nbytes in reversed(own):
        after += nbytes
        out.append(after)
    return out[::-1]
