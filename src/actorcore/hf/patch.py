"""``patch_model``: per-instance, reversible, self-checking patches for Ulysses SP (``parallel``), tiled MLP and the rest
below, built as a plan of the decoder features' options (``handle.plan``).

What a patch changes, all on this model instance only:
- Ulysses SP (``parallel.sp_size > 1``): ``_attn_implementation`` of the configs this model's attention
  modules read is set to ``actorcore_ulysses``; a hybrid model's linear-attention modules get their packed
  instance ``forward`` (``hf.features.linear_attention.GatedDeltaNetForward``), which splits their heads over the SP group.
  The SP group itself is not stored: it arrives with every call
  (``compute_logprobs(..., parallel=ctx)``), through the decoder's keyword arguments.
- Attention backend (``attention_backend``): nothing is installed; a backend named in the plan reaches every
  attention call through the decoder's keyword arguments, and every call checks that it ran in each attention layer
  (``hf.features.packed_attention``).
- Tiled MLP (``tiled_mlp_shards``): each decoder layer's MLP gets an instance ``forward`` (a
  ``hf.features.tiled_mlp.TiledMLPForward`` object that holds its module) running the original forward shard by shard
  (``kernels.tiled_mlp``); every actorcore call checks, from its trace, that it ran in every layer, so a
  transformers version that bypasses it raises ``PatchNotAppliedError`` instead of training unpatched.
- Recomputed norms (``recompute_norms``): every norm of the decoder gets an instance ``forward`` (a
  ``hf.features.norm_recompute.RecomputedNormForward``) that keeps only its input for backward and runs again there;
  every call checks that they ran.
- Activation offload (``offload_activations``): nothing is installed; the layer count in the plan makes
  every decoder call move the inputs that gradient checkpointing keeps (of all layers, or of the first K) to
  pinned CPU memory (``hf.features.offload``). Reverting also frees the offload's idle host memory.
- Compiled decoder (``compiled_decoder``, CUDA and 16-bit models only): each attention decoder layer gets an instance
  ``forward`` (``hf.features.compiled_decoder.CompiledLayerForward``) that runs the layer's compiled forward in
  actorcore's calls; every call checks that it ran in each such layer.
- MoE experts (``moe_experts``): the experts modules of the MoE layers get one shallow copy of their config that names
  actorcore's function in transformers' ``ExpertsInterface`` (``hf.features.moe_experts``; ``model.config`` is not
  touched), which runs grouped GEMMs over tokens moved with gathers only in actorcore's calls and the model's own
  experts code elsewhere; every call checks that each ran.
- quack's gated MLP (``swiglu_mlp``): each covered SwiGLU MLP runs as a subclass of its own class
  (``hf.features.swiglu_mlp.QuackGatedMLP``) whose forward runs quack's gated GEMMs in actorcore's calls; every call
  checks that each ran.
- Checkpointing (``checkpointing``, ``memory_budget_gib``): nothing is installed; the plan in ``PatchState`` sets
  each layer's checkpointing for every training call (``hf.features.checkpointing``).
- ``model._actorcore_patch`` records the patch (a ``PatchState``: its plan), with the trace slot the installed
  forwards count into during actorcore's calls.
Each of these is an option of its decoder feature (``hf.features``): the feature resolves it (its ``"auto"`` rule,
its conflicts with the other options: ``hf.features.plan``), installs it and checks in every call that it ran.
``patch_model`` only builds the plan from the features and has them install it; ``handle.plan`` shows it.
Everything the patch installs refers to modules through attributes, never closures, so ``copy.deepcopy`` and
pickling give a copy that computes with its own weights. ``handle.revert()`` restores exactly what was replaced
on the original. Nothing happens on import.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from actorcore.archs import ArchSpec, spec_for_model
from actorcore.errors import PatchNotAppliedError  # noqa: F401 (re-exported)
from actorcore.hf.call import PATCH_ATTR, DecoderParts, PatchState, patch_state
from actorcore.hf.features import DECODER_FEATURES
from actorcore.hf.features.packed_attention import require_sequence_parallel_patch  # noqa: F401 (re-exported)
from actorcore.hf.features.plan import PatchPlan, PlanFacts, build_plan, option_keywords, options_doc
from actorcore.hf.features.tiled_mlp import TiledMLPForward  # noqa: F401 (re-exported)
from actorcore.parallel import sp_size

logger = logging.getLogger(__name__)

__all__ = ["PatchHandle", "PatchNotAppliedError", "PatchPlan", "PatchState", "TiledMLPForward", "is_patched",
           "patch_model", "plan_patch", "require_sequence_parallel_patch"]


@dataclass
class PatchHandle:
    """What ``patch_model`` changed on one model; ``revert()`` undoes it (once). ``plan`` is every option's
    resolved choice and why (``print(handle.plan)``)."""

    model: torch.nn.Module
    parallel: Any
    tiled_mlp_shards: int | None
    spec: ArchSpec | None = field(default=None, repr=False)
    parts: DecoderParts | None = field(default=None, repr=False)
    state: PatchState | None = field(default=None, repr=False)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    reverted: bool = False

    @property
    def sp_size(self) -> int:
        return sp_size(self.parallel)

    @property
    def plan(self) -> PatchPlan:
        return self.state.plan

    @property
    def calls(self) -> list:
        """The plan of the latest actorcore calls on this model, as they ran (``hf.call.CallPlan``), newest last."""
        return list(self.state.calls)

    def add_undo(self, undo: Callable[[], None]) -> None:
        """Register one more restore step (for features and for wrappers such as ``compat.verl`` that change
        more)."""
        if self.reverted:
            raise ValueError("this patch was already reverted")
        self._undo.append(undo)

    def revert(self) -> None:
        """Restore every attribute the patch replaced, in reverse order."""
        if self.reverted:
            raise ValueError("this patch was already reverted")
        while self._undo:
            self._undo.pop()()
        self.reverted = True
        logger.info("reverted actorcore patch on %s", type(self.model).__name__)


def is_patched(model: torch.nn.Module) -> bool:
    return patch_state(model) is not None


def plan_patch(model: torch.nn.Module, parallel: Any = None, *, by: str = "patch_model",
               reasons: Mapping[str, str] | None = None, **options: Any) -> PatchPlan:
    """The plan ``patch_model(model, parallel, **options)`` would install, resolved and checked, without installing
    anything (``by`` / ``reasons``: an integration that asks for options, and why, shown in the plan)."""
    spec = spec_for_model(model)
    facts = PlanFacts(model=model, spec=spec, parts=DecoderParts.of(model, spec), parallel=parallel)
    return build_plan(DECODER_FEATURES, facts, {"parallel": parallel, **options}, by=by, reasons=reasons)


def install_plan(model: torch.nn.Module, plan: PatchPlan, parallel: Any = None) -> PatchHandle:
    """Have every decoder feature install its part of ``plan`` on ``model``; returns the handle. Anything a
    feature installed is undone if a later one fails."""
    if is_patched(model):
        raise ValueError(f"{type(model).__name__} is already patched by actorcore (patching twice would stack); "
                         "call handle.revert() first to patch it differently")
    spec = spec_for_model(model)
    state = PatchState(plan=plan)
    handle = PatchHandle(model=model, parallel=parallel, tiled_mlp_shards=plan.value("tiled_mlp_shards"), spec=spec,
                         parts=DecoderParts.of(model, spec), state=state)
    try:
        for feature in DECODER_FEATURES:
            feature.install(handle)
        model.__dict__[PATCH_ATTR] = state
        handle.add_undo(lambda: model.__dict__.pop(PATCH_ATTR, None))
    except BaseException:
        while handle._undo:
            handle._undo.pop()()
        raise
    logger.info("%s", plan)
    return handle


def patch_model(model: torch.nn.Module, parallel: Any = None, **options: Any) -> PatchHandle:
    """Patch this model instance: the decoder features' options, resolved into a plan (``handle.plan``: every
    choice and why), then installed. A misspelt keyword is a ``TypeError``; a bad value, a model an option does not
    cover, or two options that cannot both hold is a ``ValueError`` saying what to pass instead, before anything is
    installed. Also refused: an instance already patched, a config object shared with another patched model.

    Options (each owned by its decoder feature in ``actorcore.hf.features``):

{options}
    """
    spec_for_model(model)  # not a model of a registered architecture: that error first
    if is_patched(model):
        raise ValueError(f"{type(model).__name__} is already patched by actorcore (patching twice would stack); "
                         "call handle.revert() first to patch it differently")
    return install_plan(model, plan_patch(model, parallel, **options), parallel)


patch_model.__doc__ = patch_model.__doc__.format(options=options_doc(DECODER_FEATURES))
patch_model.__signature__ = inspect.Signature(  # what help() and IDEs show: every option's keyword and default
    [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD),
     inspect.Parameter("parallel", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
     *(inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=d)
       for k, d in option_keywords(DECODER_FEATURES).items() if k != "parallel")],
    return_annotation=PatchHandle)
