"""The packed-attention decoder feature: every softmax-attention layer runs actorcore's attention.

One process: the attention modules' configs are switched to ``actorcore_packed`` for the call
(``hf.features.attention.packed_attention``). Ulysses SP (``sp_size > 1``): ``patch_model`` switches them to
``actorcore_ulysses`` for the patch's lifetime (``install``), and a call needs that patch. Every attention call
counts itself in the call's trace (``attention:actorcore_packed`` / ``attention:actorcore_ulysses``); ``check``
requires one per attention layer, so a transformers that bypasses the registered implementation raises
``PackingNotAppliedError`` instead of returning unpacked results.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from actorcore.archs import submodule
from actorcore.archs.support import sequence_parallel_refusal
from actorcore.errors import PackingNotAppliedError
from actorcore.hf.features.attention import (
    PACKED_ATTENTION,
    attention_configs,
    current_implementations,
    packed_attention,
    register_attention,
    swap_attention_implementation,
    trace_key,
)
from actorcore.hf.call import DecoderCall, patch_state
from actorcore.hf.features.base import DecoderFeature
from actorcore.hf.features.linear_attention import check_linear_heads
from actorcore.hf.features.plan import FeatureOption, PlanFacts
from actorcore.hf.features.ulysses_attention import ULYSSES_ATTENTION, ulysses_attention_forward
from actorcore.kernels.attention.varlen import choose_backend
from actorcore.parallel import sp_size
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


class SequenceParallel(FeatureOption):
    """``parallel``: Ulysses SP over the context's SP group (its value: the SP size; None without SP)."""

    name = "parallel"
    keywords = {"parallel": None}
    off_value = None
    doc = ("an ``actorcore.ParallelContext``: with ``sp_size > 1`` the attention (and a hybrid model's linear "
           "attention) runs Ulysses sequence parallelism over its SP group; the group itself arrives with every call "
           "(``compute_logprobs(..., parallel=ctx)``). The heads must split over the SP size (refused naming the "
           "sizes that work).")

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        sp = sp_size(asked["parallel"])
        if asked["parallel"] is not None:  # the plan keeps what was asked, not the context's process groups
            asked = {"parallel": f"ParallelContext(sp_size={sp})"}
        if sp == 1:
            return self.decision(asked, None, "no sequence parallelism (sp_size 1): attention packed per call")
        why = sequence_parallel_refusal(facts.spec)
        if why:
            raise ValueError(f"Ulysses SP does not support {facts.spec.model_type}: {why}")
        layers = facts.parts.attention_layers
        heads, kv_heads = _head_counts([submodule(layer, facts.spec.attention) for layer in layers]) if layers else (
            0, 0)
        if layers:
            check_heads(heads, kv_heads, sp)
        check_linear_heads(facts.parts.linear_modules, sp)
        return self.decision(asked, sp, f"Ulysses SP over {sp} ranks ({heads} query and {kv_heads} kv heads split "
                             "per rank); patch-long: the attention modules' configs switched to actorcore_ulysses")


class AttentionBackend(FeatureOption):
    """The packed attention's kernel, as chosen from the device, the dtype and the installed packages (reported: no
    keyword sets it). A layer with a logit softcap, attention sinks or dropout may take another per call."""

    name = "attention"

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        backend = choose_backend(facts.device, facts.dtype, None, 0.0)
        why = {"flash_attn": "flash-attn is installed and the model is a 16-bit CUDA model",
               "torch_varlen": "torch's varlen_attn on a 16-bit CUDA model (flash-attn is not installed)",
               }.get(backend, f"one SDPA call per sequence: a {facts.device.type} {str(facts.dtype)[6:]} model (the "
                              "varlen kernels take 16-bit CUDA inputs)")
        return self.decision(asked, backend, why + "; layers with a logit softcap, sinks or dropout choose per call")


class PackedAttention(DecoderFeature):
    """Softmax attention: packed for the call (one process) or Ulysses for the patch's lifetime (SP)."""

    name = "packed_attention"
    options = (SequenceParallel(), AttentionBackend())
    after = ("activation_offload",)

    def install(self, handle: Any) -> None:
        layers = handle.parts.attention_layers
        if handle.state.sp_size == 1 or not layers:
            return
        configs = attention_configs(layers, handle.spec.attention)
        if ULYSSES_ATTENTION in current_implementations(configs):
            raise ValueError("this model's attention already runs actorcore's Ulysses attention although the model "
                             "is not patched: it shares its config object with another patched model, so patching "
                             "one switches both; build each model from its own config (copy.deepcopy(config))")
        name = register_attention(ULYSSES_ATTENTION, ulysses_attention_forward)
        handle.add_undo(swap_attention_implementation(configs, name))

    def active(self, call: DecoderCall) -> bool:
        return True

    def enter(self, call: DecoderCall) -> contextlib.AbstractContextManager:
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
