"""Per-call activation checkpointing of the decoder layers (``patch_model(checkpointing=..., memory_budget_gib=...)``).

Modes (``None`` leaves the model's own setting, the behaviour before this option existed):
- ``"full"``: every layer under torch's non-reentrant checkpoint (its forward runs again in backward); a layer that
  runs compiled is checkpointed inside its compiled graph (``compiled_decoder.InGraphCheckpoint``), whose backward
  recomputes only what backward needs (not the MLP's down projection).
- ``"selective"``: every layer keeps its matmul and attention outputs and recomputes the rest
  (``kernels.selective_checkpoint``; bitwise the gradients of ``"full"``). A compiled layer
  (``hf.features.compiled_decoder``) is not checkpointed at all instead: its compiled graph already keeps the matmul outputs and recomputes the
  fused pointwise work in its backward.
- ``"auto"``: within ``memory_budget_gib`` (from the call's token count, the memory already allocated and each
  layer's bytes per token), the plan that redoes the least forward work: the LAST layers run as in ``"selective"``,
  the others as in ``"full"``; a compiled layer whose MLP is quack's gated MLP (``hf.features.swiglu_mlp``) may also
  run kept but for that MLP's ``[T, 2I]`` gate/up output (``"gate_up"``: its backward runs the gate/up GEMM again,
  about a third of the layer's forward, for three quarters of its bytes), between the two. The last ones kept,
  because backward reaches them first and activation offload (``hf.features.offload``) moves the first ones. A
  layer's bytes per token are estimated from the config until a CUDA call has measured what the layer keeps in each
  mode (``LayerBytesMeter``; kept on the patch), then the measurement plans. The estimate cannot know which norms
  and casts the compiled graph keeps: above the measurement on the 1.5B shape, 10% under it on the 8B shape (whose
  first call stayed within 40 GiB, at 39.9); the measurement fills the budget. Beside the kept layers the plan counts the checkpointed inputs on the
  device (activation offload's moved ones off it but for two under way), the LM head's weight gradient until the
  last layer's backward, and, in a step's first micro-batch, the weight gradients backward allocates as it goes
  (``gradients_to_come``). Under FSDP2 it also counts the whole parameters and gradients FSDP2 holds beside them
  (``parallel.fsdp_memory``): the running and prefetched layers', a group's held after forward (the root's), and the
  output layer's gradient until the root reduce-scatters it after the whole backward.

The ``Checkpointing`` decoder feature sets, for each training call, the layers' ``gradient_checkpointing`` /
``_gradient_checkpointing_func`` and restores them afterwards (the functions travel with the autograd graph into
backward); it records the plan in ``call.checkpoint_modes`` (activation offload reads which layers are
checkpointed). Trace keys: ``checkpoint:full_layers``, ``checkpoint:selective_layers``,
``checkpoint:compiled_layers_kept``, ``checkpoint:gate_up_layers`` (layers per mode in the call) and
``checkpoint:selective`` (each selective checkpoint that ran: the self-check; a ``"gate_up"`` layer's MLP is checked
by the swiglu_mlp feature, in whose path the mode lives); a fully checkpointed compiled layer must count under the
compiled decoder's ``CHECKPOINTED_IN_GRAPH_KEY`` or ``CHECKPOINTED_AROUND_KEY``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint

from actorcore.archs import text_config
from actorcore.errors import PatchNotAppliedError
from actorcore.hf.call import UNCHECKPOINTED_MODES, DecoderCall
from actorcore.hf.features.base import DecoderFeature
from actorcore.hf.features.compiled_decoder import (CHECKPOINTED_AROUND_KEY, CHECKPOINTED_IN_GRAPH_KEY,
                                                     InGraphCheckpoint, compiled_layers, in_graph_refusal)
from actorcore.hf.features.plan import FeatureOption, PlanFacts
from actorcore.hf.features.moe_experts import is_standard_experts
from actorcore.hf.features.swiglu_mlp import gate_up_recomputed, quack_mlps
from actorcore.hf.features.offload import OFFLOAD_IN_FLIGHT
from actorcore.kernels.selective_checkpoint import (GROUPED_GEMM_OPS, SELECTIVE_TRACE_KEY, KeptLayer, cheapest_plan,
                                                    gradients_by_layer, selective_checkpoint_function,
                                                    unallocated_gradient_bytes)
from actorcore.parallel.fsdp_memory import fsdp_gathered_bytes
from actorcore.sizes import positive_size

logger = logging.getLogger(__name__)

CHECKPOINT_MODES = ("full", "selective", "auto")
FULL_LAYERS = "checkpoint:full_layers"
SELECTIVE_LAYERS = "checkpoint:selective_layers"
UNCHECKPOINTED_LAYERS = "checkpoint:compiled_layers_kept"
GATE_UP_LAYERS = "checkpoint:gate_up_layers"


@dataclass(frozen=True)
class CheckpointPlan:
    """What the patch asked for: a mode and, for ``"auto"``, the budget in bytes."""

    mode: str
    budget_bytes: float | None = None

    def __str__(self) -> str:
        return repr(self.mode) if self.budget_bytes is None else f"'{self.mode}' ({self.budget_bytes / 2**30:g} GiB)"


def check_checkpointing(mode: Any, memory_budget_gib: Any) -> CheckpointPlan | None:
    if mode is None:
        if memory_budget_gib is not None:
            raise ValueError("memory_budget_gib is the budget of checkpointing='auto'; pass checkpointing='auto'")
        return None
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpointing must be None, 'full', 'selective' or 'auto', got {mode!r}")
    if mode != "auto":
        if memory_budget_gib is not None:
            raise ValueError(f"memory_budget_gib is only used by checkpointing='auto', not {mode!r}")
        return CheckpointPlan(mode)
    budget = positive_size("memory_budget_gib", memory_budget_gib, unit="GiB", integer=False,
                           hint="checkpointing='auto' keeps as many layers as this budget fits; pass e.g. 40")
    return CheckpointPlan(mode, budget * 2**30)


@dataclass(frozen=True)
class LayerWidths:
    """A decoder layer's widths from its config: hidden, attention heads, q and kv widths, routed experts per token
    (0: dense) and the MLP's intermediate width a token passes through (an MoE layer's routed and shared experts)."""

    d: int
    heads: int
    q: int
    kv: int
    experts: int
    inner: int

    @classmethod
    def of(cls, config: Any) -> "LayerWidths":
        d, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or d // heads
        experts = getattr(config, "num_experts_per_tok", None) or 0
        if experts and getattr(config, "moe_intermediate_size", None):
            inner = experts * config.moe_intermediate_size + (getattr(config, "shared_expert_intermediate_size", 0)
                                                               or 0)
        else:
            experts, inner = 0, config.intermediate_size
        kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
        return cls(d, heads, heads * head_dim, kv, experts, inner)


def layer_bytes_per_token(config: Any, element_bytes: int, fused: bool) -> tuple[float, float]:
    """Estimated activation bytes per token of one decoder layer: (kept beyond a checkpointed layer, the
    checkpointed layer's own input). From the config's widths; an MoE layer counts its routed copies."""
    w = LayerWidths.of(config)
    routed = 2 * w.experts * w.d  # tokens permuted to their experts and the experts' outputs
    # Fused: the compiled graph's saved tensors (its partitioner recomputing the pointwise work: 49.3 KB per token
    # measured on the Qwen2.5-1.5B shape, 2d + 2q + 2kv + 2 inner counts 49.2; 126.8 KB on the Qwen3-30B-A3B
    # shape, counted 116.7): 2d more as slack. Selective: the matmul and attention outputs.
    widths = (4 if fused else 3) * w.d + 2 * w.q + 2 * w.kv + 2 * w.inner + routed
    return float(widths * element_bytes + 4 * w.heads), float(w.d * element_bytes)


def layer_forward_flops(config: Any, context: float, down_projection: bool = True) -> float:
    """FLOPs per token of one attention layer's forward (what full checkpointing runs again): its matmuls (an MoE
    layer's routed experts and shared expert) and its attention over ``context`` earlier tokens on average.
    ``down_projection=False``: a dense layer's without its MLP's down projection, which a compiled layer checkpointed
    inside its graph does not run again (``compiled_decoder.InGraphCheckpoint``; an MoE layer's experts need theirs
    for the routing weights' gradient)."""
    w = LayerWidths.of(config)
    down = 1 if down_projection or w.experts else 0
    return 2.0 * (w.d * (2 * w.q + 2 * w.kv) + (2 + down) * w.d * w.inner) + 4.0 * w.q * context


def mean_context(cu_seqlens: torch.Tensor) -> float:
    """How many tokens a token attends to, on average over a packed batch (causal: ``(s + 1) / 2`` in a sequence of
    ``s``)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
    return float((lengths * (lengths + 1) / 2).sum() / lengths.sum().clamp(min=1))


@dataclass(frozen=True)
class CallShape:
    """What a call's plan depends on beyond the model: tokens on this rank, bytes per element, bytes the allocator
    holds, the average attention context, per layer the intermediate width of the quack MLPs whose gate/up output
    it may drop (``"gate_up"``; 0: none), the head's weight gradient (``head_gradient_bytes``), the gradients
    this call's backward allocates anew (``gradients_to_come``: per layer, and the head's) and FSDP2's whole
    parameters and gradients beside every layer's backward, beyond what the allocator holds (``fsdp_bytes``:
    ``parallel.fsdp_memory``)."""

    tokens: int
    element_bytes: int
    allocated_bytes: float
    context: float = 0.0
    gate_up_widths: tuple[int, ...] = ()
    head_bytes: float = 0.0
    grads_to_come: tuple[float, ...] = ()
    head_grad_to_come: float = 0.0
    fsdp_bytes: float = 0.0


def head_gradient_bytes(model: Any) -> float:
    """Bytes of the LM head's weight gradient: formed by the loss-fused head in the forward (by the log-prob head at
    the start of backward) and alive beside every kept layer until autograd accumulates it, before the last layer's
    backward (1.2 GiB on the Qwen3-8B shape). 0 for a frozen head."""
    weight = _head_weight(model)
    if weight is None or not weight.requires_grad:
        return 0.0
    return float(weight.numel() * weight.element_size())


def _head_weight(model: Any) -> torch.Tensor | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def gradients_to_come(model: Any, layers: list[torch.nn.Module]) -> tuple[tuple[float, ...], float]:
    """The weight-gradient bytes this call's backward allocates anew (``unallocated_gradient_bytes``: the first
    micro-batch of a step): per decoder layer, each there from that layer's backward on, and the head's, there from
    the start of backward. A later micro-batch accumulates into gradients the allocator already counts."""
    head = _head_weight(model)
    return (tuple(float(unallocated_gradient_bytes(layer.parameters())) for layer in layers),
            float(unallocated_gradient_bytes([head] if head is not None else [])))


def planned_shape(model: Any, layers: list[torch.nn.Module], shape: CallShape) -> CallShape:
    """``shape`` with what ``"auto"`` counts beyond the call's tokens: the head's weight gradient, the gradients to
    come and, under FSDP2, its whole copies (``fsdp_gathered_bytes``). A head gradient FSDP2 holds whole to the end
    of backward counts among those, not as the tail, and its shard comes after every layer's backward; a layer whose
    gradients FSDP2 keeps whole (no gradient sync) has those to come instead of its shards; the layers compute in
    FSDP2's ``param_dtype``."""
    grads, head_grad = gradients_to_come(model, layers)
    gathered = fsdp_gathered_bytes(model, layers, _head_weight(model))
    if gathered.layer_gradients:  # kept whole, not reduce-scattered into shards
        grads = tuple(g if whole is None else whole for g, whole in zip(grads, gathered.layer_gradients))
    held = gathered.head_gradient_held
    return replace(shape, element_bytes=gathered.compute_element_bytes or shape.element_bytes,
                   head_bytes=(0.0 if held else head_gradient_bytes(model)) + gathered.tail, grads_to_come=grads,
                   head_grad_to_come=0.0 if held else head_grad, fsdp_bytes=gathered.held + gathered.window)


def plan_layer_modes(plan: CheckpointPlan, fused: list[bool], shape: CallShape, config: Any,
                     measured: dict[tuple[int, str], float] | None = None, offloaded: int | str = 0,
                     in_graph: list[bool] | None = None) -> list[str]:
    """Each layer's mode for one call: ``"full"``, ``"selective"``, ``"none"`` (a compiled layer under ``"auto"``,
    kept whole: its compiled graph keeps the matmul outputs and recomputes its pointwise work) or ``"gate_up"`` (a
    compiled layer with quack's gated MLP kept whole but for the MLP's ``[T, 2I]`` gate/up output, which its backward
    makes again: ``swiglu_mlp.gate_up_recomputed``).

    Under ``"auto"`` the plan redoing the least forward work within the budget (``cheapest_plan``): a ``"gate_up"``
    layer redoes its gate/up GEMM, a ``"full"`` one its forward (a compiled dense layer checkpointed inside its graph,
    all but its down projection; ``in_graph``: the layers that are, by default the compiled ones; a class that fell
    back to torch's checkpoint around its graph redoes it whole). ``measured``: bytes per token that layer ``i`` was
    measured to keep in mode ``m`` beyond a checkpointed layer (``LayerBytesMeter``, earlier calls), used in place of
    the estimate from the config. ``offloaded`` (activation offload): K, the leading layers whose checkpointed input moves to the host, or
    ``"auto"``, every layer this plan fully checkpoints (the leading ones). Their inputs are not counted on the GPU but
    for ``OFFLOAD_IN_FLIGHT`` of them; under K ``"auto"`` keeps no fused layer among the K (a compiled layer kept whole
    has no checkpointed input to move; a selective one has), under ``"auto"`` a layer's input counts with what it
    keeps, since only a full layer's moves."""
    kept = ["none" if f else "selective" for f in fused]
    if plan.mode == "full":
        return ["full"] * len(fused)
    if plan.mode == "selective":
        if any(fused):
            raise ValueError("checkpointing='selective' on compiled layers: the plan refuses this pair at patch time")
        return kept
    measured, tokens, element = measured or {}, shape.tokens, shape.element_bytes
    widths = shape.gate_up_widths or (0,) * len(fused)
    per_layer = [layer_bytes_per_token(config, element, f) for f in fused]
    full_cost = [layer_forward_flops(config, shape.context, down_projection=not g) for g in in_graph or fused]
    follow = offloaded == "auto"
    moved = len(fused) if follow else min(int(offloaded), len(fused))
    keep_options, partial_options, whole = [], [], []
    for i, (mode, (estimate, inp)) in enumerate(zip(kept, per_layer)):
        kept_bytes = measured.get((i, mode), estimate)
        whole.append(kept_bytes * tokens)
        # Under "auto" offload a layer kept in any way keeps its input on the GPU; a full one's moves.
        stays = inp * tokens if follow else 0.0
        keep_options.append(KeptLayer(kept_bytes * tokens + stays, kept_bytes * tokens))
        if not (fused[i] and widths[i]):
            partial_options.append(None)
            continue
        preact = 2 * widths[i] * element
        partial_bytes = measured.get((i, "gate_up"), max(kept_bytes - preact, 0.0))
        # Its backward: its gradients (about a kept layer's bytes) and the pre-activation made again.
        partial_options.append(KeptLayer(partial_bytes * tokens + stays,
                                         (2 * kept_bytes - partial_bytes) * tokens,
                                         2.0 * config.hidden_size * 2 * widths[i]))
    fused_offloaded = [] if follow else [i for i in range(moved) if fused[i]]
    for i in range(fused_offloaded[-1] + 1 if fused_offloaded else 0):
        # offloaded compiled layers stay fully checkpointed: no kept or partial way in front of them either
        keep_options[i] = KeptLayer(keep_options[i].kept, float("inf"))
        partial_options[i] = None
    on_gpu = sum(inp for _, inp in per_layer[moved:]) * tokens
    in_flight = sum(sorted((inp for _, inp in per_layer[:moved]), reverse=True)[:OFFLOAD_IN_FLIGHT]) * tokens
    # Beside the kept layers: the checkpointed inputs on the GPU (those moving: the few under way), FSDP2's whole
    # copies and 1 GiB of slack (the head's chunk workspace); the head's weight gradient beside them until the last
    # layer's backward.
    base = shape.allocated_bytes + on_gpu + in_flight + shape.fsdp_bytes + 2**30
    # At a layer's backward, the weight gradients allocated anew from there on (its own, the later layers', the
    # head's); a fully checkpointed layer's recompute and gradients (its input, if kept, not among them).
    grads_from = gradients_by_layer(shape.grads_to_come or (0.0,) * len(fused), shape.head_grad_to_come)
    ways = cheapest_plan(plan.budget_bytes, base, full_cost, keep_options, partial_options,
                         tail_bytes=shape.head_bytes, grads_from=grads_from,
                         recompute_bytes=3 * max(whole, default=0.0))
    return [{"full": "full", "partial": "gate_up", "kept": mode}[way] for way, mode in zip(ways, kept)]


MEASURE_MARGIN = 1.05  # on a measured layer's bytes: allocator rounding and packs of other lengths


class LayerBytesMeter:
    """Measures, in a CUDA training call, the activation bytes each kept layer holds after its forward: the
    allocator's count after the layer minus before it, less the layer's output (a checkpointed layer holds that
    too). Kept layers only, once per call (a selective layer's recompute in backward runs after the meter is
    removed); hooks run in the order that leaves an FSDP2 layer's gathered parameters outside the window."""

    def __init__(self, layers: list[torch.nn.Module], modes: list[str], tokens: int, output_bytes_per_token: float,
                 allocated: Callable[[], int]) -> None:
        self.tokens, self.output_bytes, self.allocated = tokens, output_bytes_per_token, allocated
        self.per_token: dict[tuple[int, str], float] = {}
        self._before: dict[int, int] = {}
        self._handles = []
        for i, (layer, mode) in enumerate(zip(layers, modes) if tokens else ()):
            if mode == "full":
                continue
            self._handles.append(layer.register_forward_pre_hook(functools.partial(self._enter, i)))
            self._handles.append(layer.register_forward_hook(functools.partial(self._exit, i, mode), prepend=True))

    def _enter(self, index: int, module: Any, args: Any) -> None:
        self._before.setdefault(index, self.allocated())

    def _exit(self, index: int, mode: str, module: Any, args: Any, output: Any) -> None:
        if (index, mode) in self.per_token or index not in self._before:
            return
        held = self.allocated() - self._before[index]
        self.per_token[(index, mode)] = max(0.0, held / self.tokens - self.output_bytes) * MEASURE_MARGIN

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def record_into(self, measured: dict[tuple[int, str], float]) -> bool:
        """Keep the largest measurement of each (layer, mode) in the patch's ``measured``; whether one grew."""
        grew = False
        for key, value in self.per_token.items():
            if value > measured.get(key, 0.0):
                measured[key], grew = value, True
        return grew


@contextlib.contextmanager
def checkpointing_for_call(layers: list[torch.nn.Module], modes: list[str], trace: Counter,
                           fused: frozenset[int] = frozenset()) -> Iterator[None]:
    """Set each layer's checkpointing for one call (``modes`` from ``plan_layer_modes``; ``fused``: the layers that run
    compiled in it, whose full checkpoint goes inside their compiled graph) and restore it after."""
    saved = [(layer, {k: layer.__dict__[k] for k in ("gradient_checkpointing", "_gradient_checkpointing_func")
                      if k in layer.__dict__}) for layer in layers]
    try:
        for i, (layer, mode) in enumerate(zip(layers, modes)):
            layer.gradient_checkpointing = mode not in UNCHECKPOINTED_MODES
            if mode == "selective":
                layer._gradient_checkpointing_func = selective_checkpoint_function(trace, in_place_outputs(layer))
            elif mode == "full" and i in fused:
                layer._gradient_checkpointing_func = InGraphCheckpoint(layer)
            elif mode == "full" and not _non_reentrant(layer.__dict__.get("_gradient_checkpointing_func")):
                layer._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                                       use_reentrant=False)
        trace[FULL_LAYERS] += modes.count("full")
        trace[SELECTIVE_LAYERS] += modes.count("selective")
        trace[UNCHECKPOINTED_LAYERS] += modes.count("none")
        trace[GATE_UP_LAYERS] += modes.count("gate_up")
        with gate_up_recomputed([layer for layer, mode in zip(layers, modes) if mode == "gate_up"]):
            yield
    finally:
        for layer, attrs in saved:
            for key in ("gradient_checkpointing", "_gradient_checkpointing_func"):
                layer.__dict__.pop(key, None)
            layer.__dict__.update(attrs)


def in_place_outputs(layer: torch.nn.Module) -> tuple[str, ...]:
    """The expensive ops whose outputs this layer's own code writes into in place, so a selective checkpoint
    recomputes them rather than keeping them: transformers' standard experts with biases add the bias into their
    grouped / batched GEMMs' output (``out.add_(bias)``; gpt-oss), which a kept output cannot take. actorcore's
    experts path (``moe_experts``) adds it out of place: its GEMMs stay kept."""
    for module in layer.modules():
        if getattr(module, "has_bias", False) and is_standard_experts(module):
            return GROUPED_GEMM_OPS
    return ()


def _non_reentrant(fn: Any) -> bool:
    return (isinstance(fn, functools.partial) and fn.func is torch.utils.checkpoint.checkpoint
            and fn.keywords.get("use_reentrant") is False and "context_fn" not in fn.keywords)


def check_fused_checkpointed(ran: int, full_fused: int, model_name: str) -> None:
    """Every fully checkpointed compiled layer must have been checkpointed, inside its graph or around it (``ran``
    of them were)."""
    if ran < full_fused:
        raise PatchNotAppliedError(
            f"{full_fused - ran} of {full_fused} fully checkpointed compiled decoder layers of {model_name} ran "
            "without a checkpoint: the installed transformers bypassed the layers' _gradient_checkpointing_func (it "
            "checkpoints only in training mode: call model.train()); refusing to continue without the checkpointing "
            "that was asked for")


def check_selective_ran(ran: int, selective_layers: int, model_name: str) -> None:
    """Every selective layer must have entered its selective checkpoint in this forward (``ran`` of them did)."""
    if ran < selective_layers:
        raise PatchNotAppliedError(
            f"selective checkpointing ran in {ran} of {selective_layers} decoder layers of {model_name}: the installed "
            "transformers bypassed the layers' _gradient_checkpointing_func (it checkpoints only in training mode: "
            "call model.train()); refusing to continue without the checkpointing that was asked for")


def allocated_bytes_counter(device: torch.device) -> Callable[[], int] | None:
    """The allocator's count of allocated bytes on ``device`` (read on the host, no sync); None where there is none."""
    if device.type != "cuda":
        return None
    return functools.partial(torch.cuda.memory_allocated, device)


class CheckpointingOption(FeatureOption):
    """``checkpointing`` and its budget ``memory_budget_gib``: a ``CheckpointPlan`` or None."""

    name = "checkpointing"
    keywords = {"checkpointing": None, "memory_budget_gib": None}
    off_value = None
    doc = ("``None`` (default) keeps the model's own setting; ``'full'`` checkpoints every layer; ``'selective'`` "
           "keeps every layer's matmul and attention outputs and recomputes the rest (bitwise the gradients of "
           "``'full'``); ``'auto'`` with ``memory_budget_gib`` keeps as many of the last layers as the budget fits "
           "(estimated per call from the config and the token count, then measured on CUDA), the others fully "
           "checkpointed: a kept layer runs selectively, or, fused, as its compiled graph keeps it; a compiled layer "
           "with quack's gated MLP may instead keep all but its gate/up output (made again in backward) where that "
           "redoes less work in the budget.")

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        plan = check_checkpointing(asked["checkpointing"], asked["memory_budget_gib"])
        if plan is None:
            return self.decision(asked, None, "the model's own checkpointing setting, untouched")
        if plan.mode == "auto":
            why = (f"per training call, as many of the last layers as {plan.budget_bytes / 2**30:g} GiB fits keep "
                   "their activations (selectively; a compiled layer as its compiled graph keeps them, or all but "
                   "its quack MLP's gate/up output), the others fully checkpointed: the least work redone")
        else:
            why = {"full": "every layer under torch's non-reentrant checkpoint",
                   "selective": "every layer keeps its matmul and attention outputs and recomputes the rest"}[plan.mode]
        return self.decision(asked, plan, why, range(len(facts.parts.layers)))


class Checkpointing(DecoderFeature):
    """``patch_model(checkpointing=..., memory_budget_gib=...)``: the layers' checkpointing of each training call,
    planned per call; ``check`` requires every selective layer to have entered its selective checkpoint. Entered
    before the activation offload, which wraps the checkpoint functions set here."""

    name = "checkpointing"
    options = (CheckpointingOption(),)
    after = ("vision_inputs",)

    def active(self, call: DecoderCall) -> bool:
        return (call.patch is not None and call.patch.value("checkpointing") is not None and call.model.training
                and torch.is_grad_enabled())

    def enter(self, call: DecoderCall) -> Any:
        param = next(call.model.parameters())
        allocated_now = allocated_bytes_counter(param.device)
        allocated = allocated_now() if allocated_now is not None else 0
        fused = compiled_layers(call)
        tokens = call.batch.num_tokens // call.sp_size  # this rank's shard
        config = text_config(call.model.config)
        plan, measured = call.patch.value("checkpointing"), call.patch.measured_layer_bytes
        layers = call.parts.layers
        widths = tuple(sum(mlp.gate_proj.out_features for mlp in quack_mlps(layer)) if i in fused else 0
                       for i, layer in enumerate(layers)) if plan.mode == "auto" else ()
        shape = CallShape(tokens, param.element_size(), allocated, mean_context(call.batch.cu_seqlens), widths)
        in_graph = None  # which compiled layers a full checkpoint goes inside of: priced under "auto" only
        if plan.mode == "auto":
            shape = planned_shape(call.model, layers, shape)
            in_graph = [i in fused and in_graph_refusal(layer) is None for i, layer in enumerate(layers)]
        call.checkpoint_modes = plan_layer_modes(plan, [i in fused for i in range(len(layers))], shape, config,
                                                 measured, call.patch.value("offload_activations"), in_graph)
        if plan.mode == "auto":
            logger.debug("checkpointing='auto': %d tokens, %.2f GiB allocated, %.2f GiB of FSDP2 copies beside them, "
                         "layer modes %s", tokens, shape.allocated_bytes / 2**30, shape.fsdp_bytes / 2**30,
                         call.checkpoint_modes)
        meter = None
        if plan.mode == "auto" and allocated_now is not None:
            meter = LayerBytesMeter(call.parts.layers, call.checkpoint_modes, tokens,
                                    config.hidden_size * shape.element_bytes, allocated_now)
        return self._planned(call, meter, fused)

    @contextlib.contextmanager
    def _planned(self, call: DecoderCall, meter: LayerBytesMeter | None, fused: frozenset[int]) -> Iterator[None]:
        try:
            with checkpointing_for_call(call.parts.layers, call.checkpoint_modes, call.trace, fused):
                yield
            if meter is not None and meter.record_into(call.patch.measured_layer_bytes):
                logger.info("checkpointing='auto' on %s: measured %s bytes per token kept per layer; the next calls "
                            "plan with them", call.model_name,
                            sorted({round(v) for v in call.patch.measured_layer_bytes.values()}))
        finally:
            if meter is not None:
                meter.remove()

    def check(self, call: DecoderCall) -> None:
        check_selective_ran(call.ran(SELECTIVE_TRACE_KEY), call.checkpoint_modes.count("selective"), call.model_name)
        fused = compiled_layers(call)
        full_fused = sum(mode == "full" and i in fused for i, mode in enumerate(call.checkpoint_modes))
        check_fused_checkpointed(call.ran(CHECKPOINTED_IN_GRAPH_KEY) + call.ran(CHECKPOINTED_AROUND_KEY), full_fused,
                                 call.model_name)
