"""``patch_model``: per-instance, reversible, self-checking patches for Ulysses SP, tiled MLP and the rest below.

What a patch changes, all on this model instance only:
- Ulysses SP (``parallel.sp_size > 1``): ``_attn_implementation`` of the configs this model's attention
  modules read is set to ``actorcore_ulysses``; a hybrid model's linear-attention modules get their packed
  instance ``forward`` (``hf.features.linear_attention.GatedDeltaNetForward``), which splits their heads over the SP group.
  The SP group itself is not stored: it arrives with every call
  (``compute_logprobs(..., parallel=ctx)``), through the decoder's keyword arguments.
- Tiled MLP (``tiled_mlp_shards``): each decoder layer's MLP gets an instance ``forward`` (a
  ``hf.features.tiled_mlp.TiledMLPForward`` object that holds its module) running the original forward shard by shard
  (``kernels.tiled_mlp``); every actorcore call checks, from its trace, that it ran in every layer, so a
  transformers version that bypasses it raises ``PatchNotAppliedError`` instead of training unpatched.
- Recomputed norms (``recompute_norms``): every norm of the decoder gets an instance ``forward`` (a
  ``hf.features.norm_recompute.RecomputedNormForward``) that keeps only its input for backward and runs again there;
  every call checks that they ran.
- Activation offload (``offload_activations``): nothing is installed; the layer count in ``PatchState`` makes
  every decoder call move the inputs that gradient checkpointing keeps (of all layers, or of the first K) to
  pinned CPU memory (``hf.features.offload``). Reverting also frees the offload's idle host memory.
- Fused decoder (``fused_decoder``, CUDA and 16-bit models only): each attention decoder layer gets an instance
  ``forward`` (``hf.features.fused_decoder.FusedLayerForward``) that runs the layer's compiled forward in actorcore's calls;
  every call checks that it ran in each such layer.
- MoE experts (``moe_experts="grouped"``): each experts module of the MoE layers runs as a subclass of its own class
  (``hf.features.moe_experts.SortedExperts``) whose forward runs grouped GEMMs over tokens moved with gathers only in
  actorcore's calls; every call checks that each ran.
- Checkpointing (``checkpointing``, ``memory_budget_gib``): nothing is installed; the plan in ``PatchState`` sets
  each layer's checkpointing for every training call (``hf.features.checkpointing``).
- ``model._actorcore_patch`` records the patch (a ``PatchState``), with the trace slot the installed forwards
  count into during actorcore's calls.
Each of these is installed by its decoder feature (``install`` of the objects in ``hf.features``), which also
checks in every call that it ran.
Everything the patch installs refers to modules through attributes, never closures, so ``copy.deepcopy`` and
pickling give a copy that computes with its own weights. ``handle.revert()`` restores exactly what was replaced
on the original. Nothing happens on import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from actorcore.archs.support import tiled_mlp_refusal
from actorcore.archs import ArchSpec, spec_for_model
from actorcore.errors import PatchNotAppliedError  # noqa: F401 (re-exported)
from actorcore.hf.call import PATCH_ATTR, DecoderParts, PatchState, patch_state
from actorcore.hf.features.checkpointing import check_checkpointing
from actorcore.hf.features.dense_mlp import check_dense_mlp_request, dense_mlp_names
from actorcore.hf.features import DECODER_FEATURES
from actorcore.hf.features.fused_decoder import auto_fusion_refusal, fused_layer_indices
from actorcore.hf.features.moe_experts import check_moe_experts_request, moe_experts_kernel, moe_experts_names
from actorcore.hf.features.offload import check_offload_layers
from actorcore.hf.features.packed_attention import attention_backend_choice
from actorcore.hf.features.packed_attention import require_sequence_parallel_patch  # noqa: F401 (re-exported)
from actorcore.hf.features.tiled_mlp import TiledMLPForward  # noqa: F401 (re-exported)
from actorcore.parallel import sp_size

logger = logging.getLogger(__name__)

__all__ = ["PatchHandle", "PatchNotAppliedError", "PatchState", "TiledMLPForward", "is_patched", "patch_model",
           "require_sequence_parallel_patch"]


@dataclass
class PatchHandle:
    """What ``patch_model`` changed on one model; ``revert()`` undoes it (once)."""

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


def _check_request(spec: Any, parallel: Any, tiled_mlp_shards: int | None, recompute_norms: Any) -> None:
    sp_size(parallel)
    if tiled_mlp_shards is not None:
        if isinstance(tiled_mlp_shards, bool) or not isinstance(tiled_mlp_shards, int) or tiled_mlp_shards < 1:
            raise ValueError(f"tiled_mlp_shards must be a positive int or None, got {tiled_mlp_shards!r}")
        why = tiled_mlp_refusal(spec)
        if why:
            raise ValueError(f"tiled MLP does not support {spec.model_type}: {why}; pass tiled_mlp_shards=None "
                             "(Ulysses SP alone works for MoE models)")
    if not isinstance(recompute_norms, bool):
        raise ValueError(f"recompute_norms must be True or False, got {recompute_norms!r}")


def patch_model(model: torch.nn.Module, parallel: Any = None, tiled_mlp_shards: int | None = None,
                offload_activations: bool | int = False, recompute_norms: bool = False,
                fused_decoder: bool | str = "auto", checkpointing: str | None = None,
                memory_budget_gib: float | None = None, moe_experts: bool | str = "auto",
                dense_mlp: bool | str = "auto", attention_backend: str = "auto") -> PatchHandle:
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
    calls (``hf.features.fused_decoder``: the elementwise work between the matmuls fused; within bf16 rounding of eager).
    ``"auto"`` (default): on a CUDA model with 16-bit weights and Triton, without SP, tiled MLP, offload or
    recomputed norms (the combinations not measured on the GPU), else eager; ``True`` refuses where it cannot run
    and fuses with the other patches too; ``False`` keeps the eager forward.

    ``moe_experts``: the MoE layers' experts (transformers' standard experts class) run actorcore's path in its
    calls (``hf.features.moe_experts``): the same grouped GEMMs and gate activation, with the tokens moved to their
    experts and back by gathers in both directions instead of indexing whose backward is a scatter-add
    (deterministic; each token's sum over its experts in fp32, rounded once). ``"grouped"`` installs it on any device
    and dtype (float32 on the CPU too) and refuses a model it does not cover (no MoE layers, another experts class,
    expert parallelism); ``"auto"`` (default) installs it where the decoder is fused (measured faster there, as
    close to the fp32 model as transformers' experts) and the path covers the model, else keeps the model's own
    experts code; ``"quack"`` runs that path's SwiGLU MLP as quack's Hopper GEMMs with the token gather and the
    activation inside them (``kernels.moe_quack``; needs ``quack-kernels`` with the CuTe DSL it pins and a Hopper
    GPU, refuses other expert MLPs), which ``"auto"`` also takes where they run and cover the model;
    ``False`` keeps the model's own experts code.

    ``dense_mlp``: the SwiGLU MLPs (transformers' gated MLP with SiLU, plain projections; also MoE models' shared and
    dense MLPs) run in actorcore's calls with SwiGLU and its backward inside quack's Hopper GEMMs, the other GEMMs
    on cuBLAS (``hf.features.dense_mlp``). ``"auto"`` (default): the MLPs of the fused layers where quack runs here
    (``quack-kernels`` with the CuTe DSL it pins, a Hopper GPU); ``"quack"`` every covered MLP, refusing where quack
    cannot run; ``False`` keeps the model's own MLP code.

    ``attention_backend``: the kernel of the packed attention (``kernels.attention.backends``): ``"auto"`` (default)
    FA4 where it was measured faster and exact on this GPU, else FlashAttention-2 (flash-attn 2 or torch's varlen
    kernel), else per-sequence SDPA; ``"fa4"``, ``"flash_attn"``, ``"torch_varlen"``, ``"segments"`` that kernel in
    every attention call, refused here (``ValueError`` with the reason) where it cannot run the model's attention.
    What it comes to is logged and kept in ``handle.state.attention``.

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
    _check_request(spec, parallel, tiled_mlp_shards, recompute_norms)
    check_moe_experts_request(moe_experts)
    check_dense_mlp_request(dense_mlp)
    parts = DecoderParts.of(model, spec)
    attention = attention_backend_choice(parts, spec, attention_backend)
    offload_layers = check_offload_layers(offload_activations, len(parts.layers), type(model).__name__)
    plan = check_checkpointing(checkpointing, memory_budget_gib)
    sp = sp_size(parallel)
    fused = fused_layer_indices(model, parts, fused_decoder,
                                auto_fusion_refusal(sp, tiled_mlp_shards, offload_layers, recompute_norms))
    experts = moe_experts_names(model, parts, spec, moe_experts, fused=bool(fused))
    state = PatchState(sp_size=sp, tiled_mlp_shards=tiled_mlp_shards, offload_layers=offload_layers,
                       recompute_norms=recompute_norms, fused_layers=fused, checkpointing=plan,
                       moe_experts=experts, moe_experts_kernel=moe_experts_kernel(parts, moe_experts, experts),
                       dense_mlps=dense_mlp_names(model, parts, spec, dense_mlp, fused_layers=fused),
                       attention=attention)
    handle = PatchHandle(model=model, parallel=parallel, tiled_mlp_shards=tiled_mlp_shards, spec=spec, parts=parts,
                         state=state)
    try:
        for feature in DECODER_FEATURES:
            feature.install(handle)
        model.__dict__[PATCH_ATTR] = state
        handle.add_undo(lambda: model.__dict__.pop(PATCH_ATTR, None))
    except BaseException:
        while handle._undo:
            handle._undo.pop()()
        raise
    logger.info("patched %s: sp_size=%d tiled_mlp_shards=%s offload_layers=%d of %d recompute_norms=%s "
                "fused_layers=%d checkpointing=%s moe_experts=%d (%s) dense_mlps=%d attention=%s", type(model).__name__,
                handle.sp_size, tiled_mlp_shards, offload_layers, len(parts.layers), recompute_norms,
                len(state.fused_layers), checkpointing, len(state.moe_experts), state.moe_experts_kernel,
                len(state.dense_mlps), attention)
    return handle
