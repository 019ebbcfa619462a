"""What one packed decoder call carries: the ``DecoderCall`` every decoder feature reads, and the per-call
references that reach the modules.

Legend: ``T`` packed tokens (this rank's shard under SP), ``D`` hidden.

A ``DecoderCall`` is made once per ``compute_logprobs`` / ``compute_values`` / ``compute_loss`` call
(``hf.decoder.decoder_call``): the model, its spec (resolved once), the decoder's parts, the batch as run (padded
for SP), the ``ParallelContext``, the call's options, its patch (``PatchState``, if ``patch_model`` ran) and the
one trace ``Counter`` of the call. Features (``hf.features.base``) count in that trace and check it afterwards
with ``call.ran(key)``: the counts since the call began (the trace a caller passes may hold earlier calls).

Two references carry the call to code transformers calls for us, without module-level state:
- the decoder's keyword arguments (``PARALLEL_KWARG``, ``TRACE_KWARG``), which transformers passes down to the
  attention interface and to the layers' submodules that take ``**kwargs``;
- the patch's ``trace`` slot (``PatchState.trace``, a ``TraceRef``): forwards that ``patch_model`` installs for
  the patch's lifetime (tiled MLP, recomputed norms: called with the hidden states only) hold it, and a feature
  binds it to the call's trace for the call and its recomputation (``decoder_feature.patch_trace_bound``).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from actorcore.archs import ArchSpec, LinearAttentionSpec, submodule, text_config
from actorcore.batch import PackedBatch

# Per-call keyword arguments the decoder carries down to our attention functions (transformers passes the
# decoder's extra kwargs to the attention interface): the call's ``ParallelContext`` and its trace, a
# ``collections.Counter`` in which each attention call counts itself under ``"attention:<name>"``.
PARALLEL_KWARG = "actorcore_parallel"
TRACE_KWARG = "actorcore_trace"

PATCH_ATTR = "_actorcore_patch"
# A layer's checkpointing modes that run it without a checkpoint (hf.features.checkpointing): kept whole by its
# compiled graph, or kept but for its MLP's gate/up output.
UNCHECKPOINTED_MODES = ("none", "gate_up")


class TraceRef:
    """A trace ``Counter`` (or None) behind an opaque object: in the decoder kwargs, because pytree maps over a
    forward's kwargs (FSDP2 casts and moves them) would rebuild a ``Counter`` as a new plain dict and the counts
    would go to a copy; in a patch, as the slot its installed forwards count into (None outside actorcore's
    calls)."""

    __slots__ = ("counts", "standing_down")

    def __init__(self, counts: Any, standing_down: frozenset = frozenset()) -> None:
        self.counts = counts
        self.standing_down = standing_down  # features whose installed paths run the model's own code in this call


class ParallelRef:
    """The call's ``ParallelContext`` as the decoder kwargs carry it: an opaque object, because FSDP2's
    forward-input cast (``MixedPrecisionPolicy(cast_forward_inputs=True)``, verl's default) rebuilds every
    dataclass in a forward's kwargs with ``dataclasses.replace``, which a ``ParallelContext`` (fields set in
    ``__post_init__``) refuses."""

    __slots__ = ("context",)

    def __init__(self, context: Any) -> None:
        self.context = context


def parallel_from_kwargs(kwargs: dict[str, Any]) -> Any:
    """The ``ParallelContext`` (or None) the decoder passed down to this layer's attention."""
    ref = kwargs.get(PARALLEL_KWARG)
    return None if ref is None else ref.context


def trace_from_kwargs(kwargs: dict[str, Any]) -> Counter | None:
    """The call's trace (or None) the decoder passed down."""
    ref = kwargs.get(TRACE_KWARG)
    return None if ref is None else ref.counts


@dataclass(frozen=True)
class PatchState:
    """What is patched on a model instance: its plan (``hf.features.plan.PatchPlan``: every option's decision, what
    runs and on what); kept on the instance, so copies of the model carry it (the ``trace`` slot with them: the
    copy's installed forwards hold the copy's slot). Features read their decisions with ``value`` / ``targets``."""

    plan: Any
    # (layer, mode) -> activation bytes per token the layer was measured to keep (hf.features.checkpointing, "auto")
    measured_layer_bytes: dict[tuple[int, str], float] = field(default_factory=dict, compare=False, repr=False)
    trace: TraceRef = field(default_factory=lambda: TraceRef(None), compare=False, repr=False)
    # The plan of the latest calls (``CallPlan``), newest last: which features ran and which stood down.
    calls: deque = field(default_factory=lambda: deque(maxlen=CALLS_KEPT), compare=False, repr=False)

    def value(self, option: str) -> Any:
        return self.plan.value(option)

    def targets(self, option: str) -> tuple:
        return self.plan.targets(option)

    @property
    def sp_size(self) -> int:
        return self.plan.value("parallel") or 1


CALLS_KEPT = 8


@dataclass(frozen=True)
class CallPlan:
    """One call's plan, as it ran: the features it entered (in order) and those that stood down for it."""

    ran: tuple[str, ...]
    stood_down: tuple[str, ...] = ()
    batch_invariant: bool = False
    training: bool = False

    def __str__(self) -> str:
        down = f"; stood down: {', '.join(self.stood_down)}" if self.stood_down else ""
        kind = "batch-invariant " if self.batch_invariant else ""
        return f"{kind}{'training' if self.training else 'no-grad'} call ran {', '.join(self.ran)}{down}"


def patch_state(model: torch.nn.Module) -> PatchState | None:
    return model.__dict__.get(PATCH_ATTR)


def split_layers(config: Any, layers: Any, spec: ArchSpec) -> tuple[list[Any], list[torch.nn.Module]]:
    """``(full-attention layers, linear-attention modules)`` of a decoder, from the config's layer types."""
    linear: LinearAttentionSpec | None = spec.linear_attention
    if linear is None:
        return list(layers), []
    types = getattr(config, linear.layer_types_field, None)
    if types is None or len(types) < len(layers):
        raise ValueError(f"{spec.model_type}: config.{linear.layer_types_field}={types!r} does not name the kind of "
                         f"each of the {len(layers)} decoder layers; actorcore's spec reads it to find the "
                         "linear-attention layers")
    attention_layers, modules = [], []
    for layer, kind in zip(layers, types):
        if kind == linear.layer_type:
            modules.append(submodule(layer, linear.module))
        else:
            attention_layers.append(layer)
    return attention_layers, modules


@dataclass(frozen=True)
class DecoderParts:
    """The modules of a model's decoder that features act on, found from the spec."""

    decoder: torch.nn.Module
    layers: list[torch.nn.Module]
    attention_layers: list[torch.nn.Module]  # the layers with softmax attention
    linear_modules: list[torch.nn.Module]  # the linear-attention (Gated DeltaNet) modules of a hybrid model

    @staticmethod
    def of(model: Any, spec: ArchSpec) -> "DecoderParts":
        decoder = submodule(model, spec.decoder)
        layers = list(submodule(decoder, spec.layers))
        _check_layer_count(model, layers)
        attention_layers, linear_modules = split_layers(text_config(model.config), layers, spec)
        return DecoderParts(decoder, layers, attention_layers, linear_modules)


def _check_layer_count(model: Any, layers: Any) -> None:
    """The model's forward runs ``config.num_hidden_layers`` layers: a count edited after the model was built
    would leave layers unrun (and the packed-attention check blaming transformers), so it is named here."""
    count = getattr(text_config(model.config), "num_hidden_layers", None)
    if isinstance(count, int) and count != len(layers):
        raise ValueError(f"{type(model).__name__} has {len(layers)} decoder layers but its config says "
                         f"num_hidden_layers={count}: the config was changed after the model was built; set it "
                         f"back to {len(layers)}, or build the model from the edited config")


@dataclass
class DecoderCall:
    """One packed decoder call, as every decoder feature sees it (see the module docstring)."""

    model: Any
    spec: ArchSpec
    parts: DecoderParts
    batch: PackedBatch  # the batch as run: padded to a multiple of the SP size under SP
    parallel: Any
    trace: Counter
    patch: PatchState | None = None
    check_finite: bool = False
    batch_invariant: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # the decoder's keyword arguments (features may add)
    hidden: torch.Tensor | None = None  # the decoder's output ``[1, T, D]``, once it ran
    checkpoint_modes: list[str] | None = None  # per layer, set by hf.features.checkpointing for a training call
    standing_down: frozenset = frozenset()  # features whose installed paths stand down in this call (their names)
    notes: dict[str, Any] = field(default_factory=dict)  # what a feature keeps of this call (by the feature's name)
    start: Counter = field(default_factory=Counter)  # the trace as the call found it

    def __post_init__(self) -> None:
        self.start = Counter(self.trace)

    @property
    def model_name(self) -> str:
        return type(self.model).__name__

    @property
    def sp_size(self) -> int:
        return 1 if self.parallel is None else int(self.parallel.sp_size)

    @property
    def checkpointed_layers(self) -> list[torch.nn.Module]:
        """The layers checkpointed in this call: all, unless the call's checkpointing leaves some out."""
        if self.checkpoint_modes is None:
            return self.parts.layers
        return [layer for layer, mode in zip(self.parts.layers, self.checkpoint_modes)
                if mode not in UNCHECKPOINTED_MODES]

    def ran(self, *keys: str) -> int:
        """How often these trace keys were counted since the call began."""
        return sum(self.trace[key] - self.start[key] for key in keys)
