"""The packed-attention decoder feature: every softmax-attention layer runs actorcore's attention.

One process: the attention modules' configs are switched to ``actorcore_packed`` for the call
(``hf.features.attention.packed_attention``). Ulysses SP (``sp_size > 1``): ``patch_model`` switches them to
``actorcore_ulysses`` for the patch's lifetime (``install``), and a call needs that patch. Every attention call
counts itself in the call's trace (``attention:actorcore_packed`` / ``attention:actorcore_ulysses``); ``check``
requires one per attention layer, so a transformers that bypasses the registered implementation raises
``PackingNotAppliedError`` instead of returning unpacked results.

Its options: ``parallel`` (``SequenceParallel``) and ``attention_backend`` (``AttentionBackend``,
``kernels.attention.backends``): ``"auto"`` (default) lets each call choose from its tensors (FA4 where measured,
else FlashAttention-2), the plan showing what the model's device, dtype and attention lead to; a named backend is
refused at patch time where it cannot run the model's attention, reaches every attention call of the patch through
the decoder's kwargs (``ATTENTION_BACKEND_KWARG``), and ``check`` requires it to have run in every attention layer
(``varlen_attention:<backend>``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from actorcore.archs import submodule
from actorcore.archs.support import sequence_parallel_refusal
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
from actorcore.hf.features.linear_attention import check_linear_heads
from actorcore.hf.features.plan import FeatureOption, PlanFacts, check_choice
from actorcore.hf.features.ulysses_attention import ULYSSES_ATTENTION, ulysses_attention_forward
from actorcore.kernels.attention.backends import BACKENDS, resolve_backend
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
    """``attention_backend``: the packed attention's kernel (``kernels.attention.backends``); its value: the backend
    the request comes to for the model's softmax attention (None: the model has none)."""

    name = "attention"
    keywords = {"attention_backend": "auto"}
    off_value = None
    doc = ("the kernel of the packed attention (``kernels.attention.backends``): ``'auto'`` (default) FA4 where it was "
           "measured faster and exact on this GPU, else FlashAttention-2 (flash-attn 2 or torch's varlen kernel), else "
           "per-sequence SDPA, chosen by each call from its own tensors; ``'fa4'``, ``'flash_attn'``, "
           "``'torch_varlen'``, ``'segments'``: that kernel in every attention call (also traced into the fused "
           "decoder's compiled layers where it is ``'fa4'`` or ``'torch_varlen'``), refused here where it cannot run "
           "the model's attention, and every call checks that it ran in each attention layer.")

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        request = asked["attention_backend"]
        check_choice("attention_backend", request, BACKENDS,
                     "'auto': FA4 where it was measured faster and exact, else FlashAttention-2")
        layers = facts.parts.attention_layers
        module = submodule(layers[0], facts.spec.attention) if layers else None
        param = None if module is None else next(module.parameters(), None)
        if param is None:
            if request != "auto":
                raise ValueError(f"attention_backend={request!r}: this model has no softmax attention layer with "
                                 "parameters to run it; pass attention_backend='auto'")
            return self.decision(asked, None, "no softmax attention layer")
        head_dim = module_head_dim(module) or module.config.hidden_size // module.config.num_attention_heads
        choice = resolve_backend(request, param.device, param.dtype, head_dim=int(head_dim),
                                 softcap=getattr(module, "attn_logit_softcapping", None),
                                 dropout=float(getattr(module, "attention_dropout", 0.0) or 0.0),
                                 sinks=getattr(module, "sinks", None) is not None,
                                 window=any(getattr(submodule(layer, facts.spec.attention), "sliding_window", None)
                                            for layer in layers))
        if request != "auto":
            return self.decision(asked, choice.backend, "asked for: every attention call runs it, and each call "
                                 "checks that it ran in every attention layer")
        return self.decision(asked, choice.backend, f"auto: {choice.reason} (for the model's device, dtype and "
                             "attention; each call chooses from its own tensors)")


def requested_backend(call: DecoderCall) -> str:
    """The backend every attention call of this patch runs: the one asked for, else ``"auto"`` (each call chooses)."""
    decision = None if call.patch is None else call.patch.plan["attention"]
    return decision.value if decision is not None and decision.explicit else "auto"


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
        backend = requested_backend(call)
        if backend != "auto":
            call.kwargs[ATTENTION_BACKEND_KWARG] = backend
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
        backend = requested_backend(call)
        if backend != "auto" and call.ran(f"varlen_attention:{backend}") < layers:
            raise PackingNotAppliedError(
                f"attention_backend={backend!r} ran {call.ran(f'varlen_attention:{backend}')} times for {layers} "
                f"attention layers (trace: {dict(call.trace - call.start)}); refusing results from another backend")
