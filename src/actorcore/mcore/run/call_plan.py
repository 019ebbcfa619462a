"""One call's ``LayerPlan`` on the Megatron route: what each decoder layer runs in this call, what ran, and the
check that it did (``mcore.run.forward.run_schedule`` builds and checks it around Megatron's schedule).

The plan goes to every layer with the micro-batch (``BatchParams.layer_plan``). Its trace counts, per call (and is
added to the caller's ``trace`` of ``compute_logprobs`` / ``compute_values``):

    mcore:compiled_layers              layer forwards that ran the compiled elementwise regions
                                       (``mcore/build/layer.py``; a recompute counts again)
    mcore:recompute_kept_layers        layer forwards of a training call that kept every activation
    mcore:recompute_selective_layers   layer forwards under the selective checkpoint
    mcore:recompute_full_layers        layer forwards under the full checkpoint
    checkpoint:selective               selective checkpoint contexts entered (forward and recompute:
                                       ``kernels.selective_checkpoint``)
    moe_experts:grouped_calls          forwards of the grouped experts (``mcore/build/grouped_experts.py``), any kernel
    moe_experts:quack_calls            those of them on quack's gated GEMMs

After the call every compiled layer must have run fused, every selective layer under its selective checkpoint and
every grouped experts module of the decoder once per micro-batch, else ``FastPathNotRunError``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Iterator

import torch

from actorcore.errors import FastPathNotRunError
from actorcore.kernels.selective_checkpoint import (SELECTIVE_TRACE_KEY, gradients_by_layer,
                                                    unallocated_gradient_bytes)
from actorcore.mcore.build.gather_dispatch import (GATHER_DISPATCH_KEY, LOCAL_EXPERTS_KEY, GatherMoELayer,
                                                  GatherTokenDispatcher)
from actorcore.mcore.build.grouped_experts import GROUPED_EXPERTS_KEY, QUACK, QUACK_EXPERTS_KEY, GroupedExperts
from actorcore.mcore.build.layer import COMPILED_KEY
from actorcore.mcore.build.recompute import (SELECTIVE, LayerPlan, layer_bytes_per_token, micro_batches_in_flight,
                                             plan_layer_modes)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """This rank's decoder layers, in the order they run (chunk by chunk)."""
    return [layer for chunk in model.chunks for layer in chunk.decoder.layers]


def _is_moe(layer: torch.nn.Module) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return isinstance(layer.mlp, MoELayer)


def plan_call(model: Any, batches: list[Any], *, forward_only: bool, trace: Counter | None) -> LayerPlan:
    """The call's plan: under ``recompute``, each layer's mode for this call's largest micro-batch (this rank's
    tokens, the memory allocated now, the micro-batches alive at once); else every layer keeps its activations."""
    layers = decoder_layers(model)
    config = model.config
    tokens = max(int(b.input_ids.numel()) for b in batches) if batches else 0
    if config.sequence_parallel:
        tokens //= model.context.tp_size
    plan = LayerPlan(index={id(layer): i for i, layer in enumerate(layers)}, tokens=tokens, caller_trace=trace,
                     measured=model.measured_layer_bytes)
    if forward_only or model.recompute is None or not layers:
        return plan
    element = next(model.chunks[0].parameters()).element_size()
    per_layer = [layer_bytes_per_token(config, element, _is_moe(layer), _has_local_experts(layer)) for layer in layers]
    allocated = resident_bytes(model, len(batches))
    context = model.context
    in_flight = micro_batches_in_flight(context.pp_size, context.pp_rank, model.parallel.vp, len(batches))
    kinds = [(estimate, *(type(module).__name__ for module in layer.children())) for estimate, layer in
             zip(per_layer, layers)]  # layers built alike (the same estimate and submodule types) keep alike
    # One micro-batch: its backward allocates the gradients as it goes (several: all counted before, in allocated).
    grads_from = gradients_from(model, layers) if len(batches) == 1 and model.device.type == "cuda" else None
    modes = plan_layer_modes(model.recompute, per_layer, tokens, in_flight, allocated, model.measured_layer_bytes,
                             kinds, grads_from)
    plan.modes = {id(layer): mode for layer, mode in zip(layers, modes)}
    return plan


def resident_bytes(model: Any, micro_batches: int) -> int:
    """Device bytes the layers' activations come on top of: what is allocated now and, in a call of several
    micro-batches, the gradients the first one's backward allocates (the others run with them). 0 off CUDA, where
    there is no allocator to ask."""
    device = model.device
    if device.type != "cuda":
        return 0
    pending = gradient_bytes_to_come(model) if micro_batches > 1 else 0
    return torch.cuda.memory_allocated(device) + pending


def gradients_from(model: Any, layers: list[torch.nn.Module]) -> list[float]:
    """Per decoder layer of this rank, the gradient bytes not yet allocated that exist by its backward: its own, the
    later layers' and the rest of the model's (the output layer's from the start of backward; the embedding's, made
    last, counted with them, on the safe side)."""
    own = [unallocated_gradient_bytes(layer.parameters()) for layer in layers]
    return gradients_by_layer(own, gradient_bytes_to_come(model) - sum(own))


def gradient_bytes_to_come(model: Any) -> int:
    """Bytes of the gradients this rank's backward will allocate: its trainable parameters with neither a ``grad``
    nor a ``main_grad`` buffer yet (a gradient takes its parameter's dtype)."""
    return unallocated_gradient_bytes(p for chunk in model.chunks for p in chunk.parameters())


def _has_local_experts(layer: torch.nn.Module) -> bool:
    return isinstance(layer.mlp, GatherMoELayer) and layer.mlp.local_experts


def _decoder_experts(model: Any) -> list[GroupedExperts]:
    return [layer.mlp.experts for layer in decoder_layers(model) if _is_moe(layer)
            and isinstance(layer.mlp.experts, GroupedExperts)]


@contextlib.contextmanager
def counting_experts(model: Any, plan: LayerPlan) -> Iterator[None]:
    """Count the grouped experts' forwards of the block into the plan's trace (their modules' own counters,
    compared before and after: no state outside the model)."""
    experts = [m for chunk in model.chunks for m in chunk.modules() if isinstance(m, GroupedExperts)]
    before = [m.calls for m in experts]
    layers = [m for chunk in model.chunks for m in chunk.modules() if isinstance(m, GatherMoELayer)]
    dispatchers = [m.token_dispatcher for m in layers if isinstance(m.token_dispatcher, GatherTokenDispatcher)]
    dispatched = [d.dispatches for d in dispatchers]
    local_before = [m.local_calls for m in layers]
    try:
        yield
    finally:
        plan.trace[GATHER_DISPATCH_KEY] += sum(d.dispatches - n for d, n in zip(dispatchers, dispatched))
        plan.trace[LOCAL_EXPERTS_KEY] += sum(m.local_calls - n for m, n in zip(layers, local_before))
        for module, calls in zip(experts, before):
            ran = module.calls - calls
            plan.trace[GROUPED_EXPERTS_KEY] += ran
            if module.kernel == QUACK:
                plan.trace[QUACK_EXPERTS_KEY] += ran
            plan.experts_ran[id(module)] = ran


def check_plan_ran(model: Any, plan: LayerPlan, micro_batches: int) -> None:
    """What the plan asked for ran in this call (and is added to the caller's trace); else ``FastPathNotRunError``."""
    if plan.caller_trace is not None:
        plan.caller_trace.update(plan.trace)
    layers = decoder_layers(model)
    if model.compiled_layers and plan.trace[COMPILED_KEY] < len(layers) * micro_batches:
        raise FastPathNotRunError(f"the fused Megatron layers ran {plan.trace[COMPILED_KEY]} times for {len(layers)} "
                                  f"layers x {micro_batches} micro-batches: a layer ran Megatron's own forward")
    selective = sum(mode == SELECTIVE for mode in plan.modes.values()) * micro_batches
    if plan.trace[SELECTIVE_TRACE_KEY] < selective:
        raise FastPathNotRunError(f"the selective checkpoint ran {plan.trace[SELECTIVE_TRACE_KEY]} times for "
                                  f"{selective} planned selective layer forwards")
    missing = [m for m in _decoder_experts(model) if plan.experts_ran.get(id(m), 0) < micro_batches]
    if missing:
        raise FastPathNotRunError(f"{len(missing)} grouped experts modules of the decoder ran fewer than "
                                  f"{micro_batches} times (once per micro-batch)")
