"""``patch_model``: per-instance, reversible, self-checking patches for Ulysses SP and tiled MLP.

What a patch changes, all on this model instance only:
- Ulysses SP (``parallel.sp_size > 1``): ``_attn_implementation`` of the configs this model's attention
  modules read is set to ``actorcore_ulysses``; the modules are recorded with their ``ParallelContext``.
- Tiled MLP (``tiled_mlp_shards``): each decoder layer's MLP gets an instance ``forward`` that runs its
  original forward shard by shard (``kernels.tiled_mlp``).
- A forward hook on the decoder checks, after every forward, that the patched code ran in every layer; a
  transformers version that bypasses it raises ``PatchNotAppliedError`` instead of training unpatched.
``handle.revert()`` restores exactly what was replaced. Nothing happens on import.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from actorcore.archs import spec_for_model
from actorcore.hf.attention import CALLS, attention_configs, register_attention, swap_attention_implementation
from actorcore.hf.logprobs import resolve
from actorcore.hf.ulysses_attention import (
    CONTEXTS,
    ULYSSES_ATTENTION,
    PatchNotAppliedError,
    ulysses_attention_forward,
)
from actorcore.kernels.tiled_mlp import tiled_mlp
from actorcore.parallel.ulysses import check_heads

logger = logging.getLogger(__name__)

TILED_MLP = "actorcore_tiled_mlp"
# Tiled MLP calls, counted apart from attention ``CALLS`` so neither check can be satisfied by the other.
MLP_CALLS: Counter[str] = Counter()


@dataclass(frozen=True)
class _Registration:
    """What other code needs to know about a live patch (no reference back to the model)."""

    parallel: Any
    sp_size: int
    configs: tuple[Any, ...]


# Model instance -> its live patch. Weak: a dropped model needs no revert.
_PATCHED: "weakref.WeakKeyDictionary[torch.nn.Module, _Registration]" = weakref.WeakKeyDictionary()

__all__ = ["PatchHandle", "PatchNotAppliedError", "is_patched", "patch_model", "require_sequence_parallel_patch"]


@dataclass
class PatchHandle:
    """What ``patch_model`` changed on one model; ``revert()`` undoes it (once)."""

    model: torch.nn.Module
    parallel: Any
    tiled_mlp_shards: int | None
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _owned_configs: list[Any] = field(default_factory=list, repr=False)
    reverted: bool = False

    @property
    def sp_size(self) -> int:
        return 1 if self.parallel is None else int(self.parallel.sp_size)

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
        _PATCHED.pop(self.model, None)
        self.reverted = True
        logger.info("reverted actorcore patch on %s", type(self.model).__name__)


def is_patched(model: torch.nn.Module) -> bool:
    return model in _PATCHED


def require_sequence_parallel_patch(model: torch.nn.Module, parallel: Any) -> None:
    """Refuse an SP call on a model not patched for that SP group (its attention would be wrong silently)."""
    registration = _PATCHED.get(model)
    if registration is None or registration.sp_size == 1:
        raise ValueError(
            f"parallel has sp_size={parallel.sp_size} but {type(model).__name__} is not patched for sequence "
            "parallelism; call actorcore.patch_model(model, parallel=ctx) once after building the model"
        )
    if registration.parallel.sp_group is not parallel.sp_group:
        raise ValueError("the model was patched for a different SP group than the one passed in parallel=; "
                         "pass the same ParallelContext (or the same sp_group) that was given to patch_model")


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
    if parallel is not None and not hasattr(parallel, "sp_size"):
        raise ValueError(f"parallel must be an actorcore.ParallelContext, got {type(parallel).__name__}")
    if tiled_mlp_shards is not None:
        if isinstance(tiled_mlp_shards, bool) or not isinstance(tiled_mlp_shards, int) or tiled_mlp_shards < 1:
            raise ValueError(f"tiled_mlp_shards must be a positive int or None, got {tiled_mlp_shards!r}")
        if spec.mlp_kind == "moe":
            raise ValueError(
                f"tiled MLP does not support {spec.model_type}: its MLP is a mixture of experts (mlp_kind='moe'), "
                "whose blocks route tokens to experts (and may return router outputs), which tiled recompute does "
                "not cover; pass tiled_mlp_shards=None (Ulysses SP alone works for MoE models)"
            )


def patch_model(model: torch.nn.Module, parallel: Any = None, tiled_mlp_shards: int | None = None) -> PatchHandle:
    """Patch this model instance for Ulysses SP (``parallel.sp_size > 1``) and/or tiled MLP.

    Raises ``ValueError`` for an instance already patched, a model whose heads cannot split over the SP size
    (naming the valid sizes), tiled MLP on an MoE model, or a config object shared with another patched model.
    """
    if model in _PATCHED:
        raise ValueError(f"{type(model).__name__} is already patched by actorcore (patching twice would stack); "
                         "call handle.revert() first to patch it differently")
    spec = spec_for_model(model)
    _check_request(spec, parallel, tiled_mlp_shards)
    decoder = resolve(model, spec.decoder)
    layers = list(resolve(decoder, spec.layers))
    handle = PatchHandle(model=model, parallel=parallel, tiled_mlp_shards=tiled_mlp_shards)
    try:
        if handle.sp_size > 1:
            _patch_attention(handle, layers, spec.attention)
        if tiled_mlp_shards is not None:
            _patch_mlps(handle, [resolve(layer, spec.mlp) for layer in layers], tiled_mlp_shards)
        _install_self_check(handle, decoder, num_layers=len(layers))
    except BaseException:
        while handle._undo:
            handle._undo.pop()()
        raise
    _PATCHED[model] = _Registration(parallel=parallel, sp_size=handle.sp_size, configs=tuple(handle._owned_configs))
    logger.info("patched %s: sp_size=%d tiled_mlp_shards=%s", type(model).__name__, handle.sp_size, tiled_mlp_shards)
    return handle


def _configs_of_other_patches(model: torch.nn.Module) -> set[int]:
    return {id(c) for other, reg in _PATCHED.items() if other is not model for c in reg.configs}


def _patch_attention(handle: PatchHandle, layers: list[torch.nn.Module], attention_attr: str) -> None:
    attention_modules = [resolve(layer, attention_attr) for layer in layers]
    heads, kv_heads = _head_counts(attention_modules)
    check_heads(heads, kv_heads, handle.sp_size)
    configs = attention_configs(layers, attention_attr)
    if {id(c) for c in configs} & _configs_of_other_patches(handle.model):
        raise ValueError("this model shares its config object with another patched model, so patching one would "
                         "switch both; build each model from its own config (copy.deepcopy(config))")
    name = register_attention(ULYSSES_ATTENTION, ulysses_attention_forward)

    def forget_contexts() -> None:
        for attn in attention_modules:
            CONTEXTS.pop(attn, None)

    handle._undo.append(forget_contexts)
    for attn in attention_modules:
        CONTEXTS[attn] = handle.parallel
    handle._undo.append(swap_attention_implementation(configs, name))
    handle._owned_configs.extend(configs)


def _patch_mlps(handle: PatchHandle, mlps: list[torch.nn.Module], shards: int) -> None:
    for mlp in mlps:
        had_instance_forward = "forward" in mlp.__dict__
        previous = mlp.__dict__.get("forward")
        plain_forward = mlp.forward  # the module's own forward, read before replacing it

        def restore(mlp=mlp, had=had_instance_forward, previous=previous) -> None:
            if had:
                mlp.__dict__["forward"] = previous
            else:
                mlp.__dict__.pop("forward", None)

        handle._undo.append(restore)
        mlp.__dict__["forward"] = _tiled_forward(mlp, plain_forward, shards)


def _tiled_forward(mlp: torch.nn.Module, plain_forward: Callable, shards: int) -> Callable:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        MLP_CALLS[TILED_MLP] += 1
        # Parameters as registered now: under FSDP2, the unsharded ones its pre-forward hook installed.
        params = [p for p in mlp.parameters() if p.requires_grad]
        return tiled_mlp(plain_forward, hidden_states, shards, params)

    forward.__doc__ = f"actorcore tiled MLP ({shards} shards) around {type(mlp).__name__}.forward"
    return forward


def _install_self_check(handle: PatchHandle, decoder: torch.nn.Module, num_layers: int) -> None:
    """Decoder hooks: after each forward, every layer must have run the patched attention and MLP."""
    before: dict[str, int] = {}

    def snapshot(module: Any, args: Any, kwargs: Any = None) -> None:
        before["attention"] = CALLS[ULYSSES_ATTENTION]
        before["mlp"] = MLP_CALLS[TILED_MLP]

    def verify(module: Any, args: Any, output: Any) -> None:
        if not before:
            return
        problems = []
        if handle.sp_size > 1 and CALLS[ULYSSES_ATTENTION] - before["attention"] < num_layers:
            problems.append(f"Ulysses attention ran {CALLS[ULYSSES_ATTENTION] - before['attention']} times")
        if handle.tiled_mlp_shards is not None and MLP_CALLS[TILED_MLP] - before["mlp"] < num_layers:
            problems.append(f"tiled MLP ran {MLP_CALLS[TILED_MLP] - before['mlp']} times")
        before.clear()
        if problems:
            raise PatchNotAppliedError(
                f"actorcore patch did not take effect in {type(handle.model).__name__} ({num_layers} layers): "
                f"{'; '.join(problems)}. The installed transformers bypassed it; refusing to continue unpatched"
            )

    if handle.sp_size == 1 and handle.tiled_mlp_shards is None:
        return
    pre = decoder.register_forward_pre_hook(snapshot)
    post = decoder.register_forward_hook(verify)
    handle._undo.append(post.remove)
    handle._undo.append(pre.remove)
