"""``patch_model``: per-instance, reversible, self-checking patches for Ulysses SP and tiled MLP.

What a patch changes, all on this model instance only:
- Ulysses SP (``parallel.sp_size > 1``): ``_attn_implementation`` of the configs this model's attention
  modules read is set to ``actorcore_ulysses``; a hybrid model's linear-attention modules get their packed
  instance ``forward`` (``hf.linear_attention.GatedDeltaNetForward``), which splits their heads over the SP group.
  The SP group itself is not stored: it arrives with every call
  (``compute_logprobs(..., parallel=ctx)``), through the decoder's keyword arguments.
- Tiled MLP (``tiled_mlp_shards``): each decoder layer's MLP gets an instance ``forward`` (a ``TiledMLPForward``
  object that holds its module) running the original forward shard by shard (``kernels.tiled_mlp``); decoder
  hooks check after every forward that it ran in every layer, so a transformers version that bypasses it raises
  ``PatchNotAppliedError`` instead of training unpatched.
- Recomputed norms (``recompute_norms``): every norm of the decoder gets an instance ``forward`` (a
  ``hf.norm_recompute.RecomputedNormForward``) that keeps only its input for backward and runs again there;
  the same decoder hooks check that they ran.
- Activation offload (``offload_activations``): nothing is installed; the layer count in ``PatchState`` makes
  every decoder call move the inputs that gradient checkpointing keeps (of all layers, or of the first K) to
  pinned CPU memory (``hf.offload``). Reverting also frees the offload's idle host memory.
- Fused decoder (``fused_decoder``, CUDA and 16-bit models only): each attention decoder layer gets an
  instance ``forward`` (``hf.fused_decoder.FusedLayerForward``) that runs the layer's compiled forward in
  actorcore's calls; the decoder's trace proves it ran in every such layer.
- Checkpointing (``checkpointing``, ``memory_budget_gib``): nothing is installed; the plan in ``PatchState`` sets
  each layer's checkpointing for every training call (``hf.checkpointing``).
- ``model._actorcore_patch`` records the patch (a ``PatchState``).
Everything the patch installs refers to modules through attributes, never closures, so ``copy.deepcopy`` and
pickling give a copy that computes with its own weights. ``handle.revert()`` restores exactly what was replaced
on the original. Nothing happens on import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from actorcore.archs import spec_for_model, submodule, text_config
from actorcore.hf.attention import attention_configs, current_implementations, register_attention, swap_attention_implementation
from actorcore.hf.linear_attention import check_linear_heads, install_linear_forwards, is_installed, split_layers
from actorcore.hf.checkpointing import CheckpointPlan, check_checkpointing
from actorcore.hf.fused_decoder import check_fused_request, install_fused_layers
from actorcore.hf.instance_forwards import install_forwards, wrapped_forward
from actorcore.hf.norm_recompute import decoder_norms, install_recomputed_norms
from actorcore.hf.offload import check_checkpointed, check_offload_layers, release_offload_buffers
from actorcore.hf.ulysses_attention import ULYSSES_ATTENTION, PatchNotAppliedError, ulysses_attention_forward
from actorcore.kernels.tiled_mlp import tiled_mlp
from actorcore.parallel import sp_size
from actorcore.parallel.ulysses import check_heads

logger = logging.getLogger(__name__)

PATCH_ATTR = "_actorcore_patch"

__all__ = ["PatchHandle", "PatchNotAppliedError", "PatchState", "TiledMLPForward", "is_patched", "patch_model",
           "require_sequence_parallel_patch"]


@dataclass(frozen=True)
class PatchState:
    """What is patched on a model instance; kept on the instance, so copies of the model carry it."""

    sp_size: int
    tiled_mlp_shards: int | None
    offload_layers: int = 0  # the leading decoder layers whose checkpointed input is offloaded (0: no offload)
    recompute_norms: bool = False
    fused_layers: tuple[int, ...] = ()  # indices of the decoder layers that run the fused (compiled) forward
    checkpointing: CheckpointPlan | None = None  # None: the model's own checkpointing setting


class TiledMLPForward:
    """The instance ``forward`` of a tiled MLP: its original forward over token shards.

    An object holding its module (not a closure over it), so a deep copy of the model runs the copy's MLP.
    ``calls`` counts forwards, for the decoder's self-check.
    """

    def __init__(self, mlp: torch.nn.Module, shards: int, previous: Callable | None) -> None:
        self.mlp = mlp
        self.shards = shards
        self.previous = previous  # an instance forward that was there before, else None (the class's)
        self.calls = 0

    @torch.compiler.disable  # inside a fused (compiled) layer the tiled MLP runs as it is
    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        plain = wrapped_forward(self.mlp, self.previous)
        # Parameters as registered now: under FSDP2, the unsharded ones its pre-forward hook installed.
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        return tiled_mlp(plain, hidden_states, self.shards, params)


class ForwardsRanCheck:
    """Decoder hooks: after each forward, the instance forwards a patch installed must have run (at least as
    many calls as there are of them), else the installed transformers bypassed them."""

    def __init__(self, forwards: list, model_name: str, what: str) -> None:
        self.forwards = forwards
        self.model_name = model_name
        self.what = what
        self.before: int | None = None

    def calls(self) -> int:
        return sum(f.calls for f in self.forwards)

    def pre(self, module: Any, args: Any) -> None:
        self.before = self.calls()

    def post(self, module: Any, args: Any, output: Any) -> None:
        if self.before is None:
            return
        ran, self.before = self.calls() - self.before, None
        if ran < len(self.forwards):
            raise PatchNotAppliedError(
                f"actorcore patch did not take effect in {self.model_name}: {self.what} ran {ran} times for "
                f"{len(self.forwards)} modules. The installed transformers bypassed it; refusing to continue unpatched"
            )

    def install(self, handle: "PatchHandle", decoder: torch.nn.Module) -> None:
        pre = decoder.register_forward_pre_hook(self.pre)
        post = decoder.register_forward_hook(self.post)
        handle._undo.append(post.remove)
        handle._undo.append(pre.remove)


@dataclass
class PatchHandle:
    """What ``patch_model`` changed on one model; ``revert()`` undoes it (once)."""

    model: torch.nn.Module
    parallel: Any
    tiled_mlp_shards: int | None
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    reverted: bool = False

    @property
    def sp_size(self) -> int:
        return sp_size(self.parallel)

    def add_undo(self, undo: Callable[[], None]) -> None:
        """Register one more restore step (for wrappers such as ``compat.verl`` that change more)."""
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


def patch_state(model: torch.nn.Module) -> PatchState | None:
    return model.__dict__.get(PATCH_ATTR)


def is_patched(model: torch.nn.Module) -> bool:
    return patch_state(model) is not None


def require_sequence_parallel_patch(model: torch.nn.Module, parallel: Any) -> None:
    """Refuse an SP call on a model not patched for that SP size (its attention would be wrong silently)."""
    state = patch_state(model)
    if state is None or state.sp_size == 1:
        raise ValueError(
            f"parallel has sp_size={parallel.sp_size} but {type(model).__name__} is not patched for sequence "
            "parallelism; call actorcore.patch_model(model, parallel=ctx) once after building the model"
        )
    if state.sp_size != parallel.sp_size:
        raise ValueError(f"the model was patched for sp_size={state.sp_size} but parallel= has sp_size="
                         f"{parallel.sp_size}; pass a ParallelContext of the size given to patch_model")


def _head_counts(attention_modules: list[torch.nn.Module]) -> tuple[int, int]:
    counts = set()
    for attn in attention_modules:
        config = attn.config
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads is None:
            raise ValueError(f"{type(attn).__name__}.config has no num_attention_heads; cannot plan Ulysses SP")
        counts.add((int(heads), int(kv_heads)))
    if len(counts) != 1:
        raise ValueError(f"layers have different head counts {sorted(counts)}; Ulysses SP needs one layout")
    return counts.pop()


def _check_request(spec: Any, parallel: Any, tiled_mlp_shards: int | None) -> None:
    sp_size(parallel)
    if tiled_mlp_shards is not None:
        if isinstance(tiled_mlp_shards, bool) or not isinstance(tiled_mlp_shards, int) or tiled_mlp_shards < 1:
            raise ValueError(f"tiled_mlp_shards must be a positive int or None, got {tiled_mlp_shards!r}")
        if spec.mlp_kind == "moe":
            raise ValueError(
                f"tiled MLP does not support {spec.model_type}: its MLP is a mixture of experts (mlp_kind='moe'), "
                "whose blocks route tokens to experts (and may return router outputs), which tiled recompute does "
                "not cover; pass tiled_mlp_shards=None (Ulysses SP alone works for MoE models)"
            )


def patch_model(model: torch.nn.Module, parallel: Any = None, tiled_mlp_shards: int | None = None,
                offload_activations: bool | int = False, recompute_norms: bool = False,
                fused_decoder: bool | str = False, checkpointing: str | None = None,
                memory_budget_gib: float | None = None) -> PatchHandle:
    """Patch this model instance for Ulysses SP (``parallel.sp_size > 1``), tiled MLP, activation offload and/or
    recomputed norms.

    ``offload_activations=True``: in every training call the checkpointed decoder layers' inputs wait in pinned
    CPU memory until backward (copies on a side stream, prefetched one layer ahead; bitwise the same results).
    An int K offloads only the first K layers' inputs (host memory: K x tokens x hidden x dtype bytes per call);
    the others stay on the GPU. Needs gradient checkpointing on every layer with ``use_reentrant=False``.

    ``recompute_norms=True``: the decoder's norms keep only their input for backward and run again there
    (transformers' RMSNorm otherwise keeps an fp32 copy of its input and its normalised values: 16 GiB per norm
    at 512K tokens of an 8B model); bitwise the same results.

    ``fused_decoder``: the attention decoder layers run their forward compiled by ``torch.compile`` in actorcore's
    calls (``hf.fused_decoder``: the elementwise work between the matmuls fused; within bf16 rounding of eager).
    ``"auto"``: on a CUDA model with 16-bit weights and Triton, else eager; ``True`` refuses where it cannot run;
    ``False`` (default, until the shipped path is measured on the GPU) keeps the eager forward.

    ``checkpointing``: ``None`` (default) keeps the model's own setting; ``"full"`` checkpoints every layer;
    ``"selective"`` keeps every layer's matmul and attention outputs and recomputes the rest (bitwise the
    gradients of ``"full"``; a fused layer is not checkpointed, its compiled backward recomputes the fused
    pointwise work); ``"auto"`` with ``memory_budget_gib`` runs as many of the last layers selectively as the
    budget fits (estimated per call from the config and the token count), the others fully checkpointed.

    Raises ``ValueError`` for an instance already patched, a model whose heads cannot split over the SP size
    (naming the valid sizes), tiled MLP on an MoE model, offload without non-reentrant gradient checkpointing,
    or a config object shared with another patched model.
    """
    spec = spec_for_model(model)
    if is_patched(model):
        raise ValueError(f"{type(model).__name__} is already patched by actorcore (patching twice would stack); "
                         "call handle.revert() first to patch it differently")
    _check_request(spec, parallel, tiled_mlp_shards)
    if not isinstance(recompute_norms, bool):
        raise ValueError(f"recompute_norms must be True or False, got {recompute_norms!r}")
    checkpoint_plan = check_checkpointing(checkpointing, memory_budget_gib)
    fuse = check_fused_request(model, fused_decoder)
    decoder = submodule(model, spec.decoder)
    layers = list(submodule(decoder, spec.layers))
    offload_layers = check_offload_layers(offload_activations, len(layers), type(model).__name__)
    if offload_layers and checkpoint_plan is None:  # with a plan, each call sets the layers' checkpointing
        check_checkpointed(layers, type(model).__name__)
    handle = PatchHandle(model=model, parallel=parallel, tiled_mlp_shards=tiled_mlp_shards)
    try:
        if handle.sp_size > 1:
            attention_layers, linear_modules = split_layers(text_config(model.config), layers, spec)
            if attention_layers:
                _patch_attention(handle, attention_layers, spec.attention)
            if linear_modules:
                _patch_linear_attention(handle, linear_modules, spec.linear_attention)
        if tiled_mlp_shards is not None:
            _patch_mlps(handle, decoder, [submodule(layer, spec.mlp) for layer in layers], tiled_mlp_shards)
        if recompute_norms:
            _patch_norms(handle, decoder)
        fused_layers = _patch_fused(handle, model, layers, spec) if fuse else ()
        model.__dict__[PATCH_ATTR] = PatchState(sp_size=handle.sp_size, tiled_mlp_shards=tiled_mlp_shards,
                                                offload_layers=offload_layers, recompute_norms=recompute_norms,
                                                fused_layers=fused_layers, checkpointing=checkpoint_plan)
        handle._undo.append(lambda: model.__dict__.pop(PATCH_ATTR, None))
        if offload_layers:
            handle._undo.append(release_offload_buffers)
    except BaseException:
        while handle._undo:
            handle._undo.pop()()
        raise
    logger.info("patched %s: sp_size=%d tiled_mlp_shards=%s offload_layers=%d of %d recompute_norms=%s fused_layers=%d "
                "checkpointing=%s", type(model).__name__, handle.sp_size, tiled_mlp_shards, offload_layers, len(layers),
                recompute_norms, len(fused_layers), checkpointing)
    return handle


def _patch_attention(handle: PatchHandle, layers: list[torch.nn.Module], attention_attr: str) -> None:
    attention_modules = [submodule(layer, attention_attr) for layer in layers]
    heads, kv_heads = _head_counts(attention_modules)
    check_heads(heads, kv_heads, handle.sp_size)
    configs = attention_configs(layers, attention_attr)
    if ULYSSES_ATTENTION in current_implementations(configs):
        raise ValueError("this model's attention already runs actorcore's Ulysses attention although the model is "
                         "not patched: it shares its config object with another patched model, so patching one "
                         "switches both; build each model from its own config (copy.deepcopy(config))")
    name = register_attention(ULYSSES_ATTENTION, ulysses_attention_forward)
    handle._undo.append(swap_attention_implementation(configs, name))


def _patch_linear_attention(handle: PatchHandle, modules: list[torch.nn.Module], linear_spec: Any) -> None:
    """Ulysses SP for Gated DeltaNet layers: their packed forward, for good (it reads the SP context per call)."""
    check_linear_heads(modules, handle.sp_size)
    if any(is_installed(m) for m in modules):
        raise ValueError("this model's linear-attention modules already run actorcore's packed forward although the "
                         "model is not patched; revert the other patch (or build a fresh model) first")
    handle._undo.append(install_linear_forwards(modules, linear_spec))


def _patch_mlps(handle: PatchHandle, decoder: torch.nn.Module, mlps: list[torch.nn.Module], shards: int) -> None:
    forwards, restore = install_forwards(mlps, lambda mlp, previous: TiledMLPForward(mlp, shards, previous))
    handle._undo.append(restore)
    ForwardsRanCheck(forwards, type(handle.model).__name__, "tiled MLP").install(handle, decoder)


def _patch_norms(handle: PatchHandle, decoder: torch.nn.Module) -> None:
    norms = decoder_norms(decoder)
    if not norms:
        raise ValueError(f"recompute_norms=True: found no norm module in {type(handle.model).__name__}'s decoder "
                         "(none named ...RMSNorm / ...LayerNorm); pass recompute_norms=False")
    forwards, restore = install_recomputed_norms(norms)
    handle._undo.append(restore)
    ForwardsRanCheck(forwards, type(handle.model).__name__, "recomputed norms").install(handle, decoder)


def _patch_fused(handle: PatchHandle, model: torch.nn.Module, layers: list[torch.nn.Module], spec: Any
                 ) -> tuple[int, ...]:
    """Fused forwards on the attention layers (a hybrid model's linear-attention layers stay eager)."""
    attention_layers, _ = split_layers(text_config(model.config), layers, spec)
    ids = {id(layer) for layer in attention_layers}
    fused = [i for i, layer in enumerate(layers) if id(layer) in ids]
    _, restore = install_fused_layers([layers[i] for i in fused])
    handle._undo.append(restore)
    return tuple(fused)
