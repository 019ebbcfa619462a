"""The packed-attention decoder feature: every softmax-attention layer runs actorcore's attention.

One process: the attention modules' configs are switched to ``actorcore_packed`` for the call
(``hf.features.attention.packed_attention``). Ulysses SP (``sp_size > 1``): ``patch_model`` switches them to
``actorcore_ulysses`` for the patch's lifetime (``install``), and a call needs that patch. Every attention call
counts itself in the call's trace (``attention:actorcore_packed`` / ``attention:actorcore_ulysses``); ``check``
requires one per attention layer, so a transformers that bypasses the registered implementation raises
``PackingNotAppliedError`` instead of returning unpacked results.

The attention backend (``patch_model(attention_backend=...)``, ``kernels.attention.backends``): ``"auto"`` (default)
lets each call choose from its tensors (FA4 where measured, else FlashAttention-2); a named backend reaches every
attention call of the patch through the decoder's kwargs (``ATTENTION_BACKEND_KWARG``), is refused at patch time
where it cannot run the model's attention (``attention_backend_choice``), and ``check`` requires it to have run in
every attention layer (``varlen_attention:<backend>``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from actorcore.archs import submodule
from actorcore.errors import PackingNotAppliedError
from actorcore.hf.features.attention import (
    ATTENTION_BACKEND_KWARG,
    PACKED_ATTENTION,
    attention_configs,
    current_implementations,
    module_head_dim,
    packed_attention,
    register_attention,
    swap_attention_implementation,
    trace_key,
)
from actorcore.hf.call import DecoderCall, patch_state
from actorcore.hf.features.base import DecoderFeature
from actorcore.hf.features.ulysses_attention import ULYSSES_ATTENTION, ulysses_attention_forward
from actorcore.kernels.attention.backends import BACKENDS, BackendChoice, resolve_backend
from actorcore.parallel.ulysses import check_heads

ATTENTION_TRACE_KEYS = (trace_key(PACKED_ATTENTION), trace_key(ULYSSES_ATTENTION))


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


def attention_backend_choice(parts: Any, spec: Any, request: Any) -> BackendChoice | None:
    """What ``patch_model(attention_backend=request)`` comes to for the model's softmax attention (read off its first
    attention module: device, dtype, head dims, softcap, sinks, dropout; a window if any layer has one), for the
    patch's report; ``ValueError`` for an unknown name or a backend that cannot run that attention. None: no softmax
    attention layers."""
    if not isinstance(request, str) or request not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {request!r} ('auto': FA4 where it was "
                         "measured faster and exact, else FlashAttention-2)")
    module = submodule(parts.attention_layers[0], spec.attention) if parts.attention_layers else None
    param = None if module is None else next(module.parameters(), None)
    if param is None:
        if request != "auto":
            raise ValueError(f"attention_backend={request!r}: this model has no softmax attention layer with "
                             "parameters to run it; pass attention_backend='auto'")
        return None
    head_dim = module_head_dim(module) or module.config.hidden_size // module.config.num_attention_heads
    softcap = getattr(module, "attn_logit_softcapping", None)
    dropout = float(getattr(module, "attention_dropout", 0.0) or 0.0)
    window = any(getattr(submodule(layer, spec.attention), "sliding_window", None) for layer in parts.attention_layers)
    return resolve_backend(request, param.device, param.dtype, head_dim=int(head_dim), softcap=softcap, dropout=dropout,
                           sinks=getattr(module, "sinks", None) is not None, window=window)


def _requested_backend(call: DecoderCall) -> str:
    choice = None if call.patch is None else call.patch.attention
    return "auto" if choice is None else choice.requested


class PackedAttention(DecoderFeature):
    """Softmax attention: packed for the call (one process) or Ulysses for the patch's lifetime (SP)."""

    name = "packed_attention"

    def install(self, handle: Any) -> None:
        layers = handle.parts.attention_layers
        if handle.state.sp_size == 1 or not layers:
            return
        attention_attr = handle.spec.attention
        heads, kv_heads = _head_counts([submodule(layer, attention_attr) for layer in layers])
        check_heads(heads, kv_heads, handle.state.sp_size)
        configs = attention_configs(layers, attention_attr)
        if ULYSSES_ATTENTION in current_implementations(configs):
            raise ValueError("this model's attention already runs actorcore's Ulysses attention although the model "
                             "is not patched: it shares its config object with another patched model, so patching "
                             "one switches both; build each model from its own config (copy.deepcopy(config))")
        name = register_attention(ULYSSES_ATTENTION, ulysses_attention_forward)
        handle.add_undo(swap_attention_implementation(configs, name))

    def active(self, call: DecoderCall) -> bool:
        return True

    def enter(self, call: DecoderCall) -> contextlib.AbstractContextManager:
        if _requested_backend(call) != "auto":
            call.kwargs[ATTENTION_BACKEND_KWARG] = _requested_backend(call)
        if call.sp_size > 1:
            require_sequence_parallel_patch(call.model, call.parallel)
            return contextlib.nullcontext()
        configs = attention_configs(call.parts.attention_layers, call.spec.attention)
        # An actorcore attention may be in place already (a model patched by other means).
        if all(name and name.startswith("actorcore_") for name in current_implementations(configs)):
            return contextlib.nullcontext()
        return packed_attention(call.parts.decoder, configs, register_attention())

    def check(self, call: DecoderCall) -> None:
        ran, layers = call.ran(*ATTENTION_TRACE_KEYS), len(call.parts.attention_layers)
        if ran < layers:
            raise PackingNotAppliedError(
                f"packed attention ran {ran} times for {layers} attention layers: the installed transformers "
                "bypassed actorcore's attention; refusing to return unpacked results")
        backend = _requested_backend(call)
        if backend != "auto" and call.ran(f"varlen_attention:{backend}") < layers:
            raise PackingNotAppliedError(
                f"attention_backend={backend!r} ran {call.ran(f'varlen_attention:{backend}')} times for {layers} "
                f"attention layers (trace: {dict(call.trace - call.start)}); refusing results from another backend")
