"""Norms that keep only their input for backward (``patch_model(..., recompute_norms=True)``).

Why: transformers' RMSNorm computes in fp32, so autograd keeps the fp32 copy of its input and the normalised
values (12 bytes per element of a bf16 model, besides the output the next linear keeps anyway). Measured on the
H200 at 512K tokens of a Llama-8B shape with offload (``bench/long_context.py --memory-phases``): the step's peak
(110.8 GiB) falls in a layer's MLP backward, 32 GiB above where that layer's recompute began, and each of the
layer's two norms added 16 GiB when recomputed. Under a non-reentrant checkpoint a norm keeps only its input (2
bytes per element) and runs again in backward: bitwise the same outputs and gradients, for one more
memory-bound pass per norm.

A ``RecomputedNormForward`` is the norm's instance ``forward``: an object holding its module (so a deep copy of
the model recomputes the copy's norm) and the patch's trace slot. In actorcore's calls it counts
``recompute_norms:forward`` per forward asked for and ``recompute_norms:run`` per computation (the forward, and
its recomputation in backward); the ``RecomputedNorms`` feature requires one forward per norm of the decoder.
Outside autograd (no gradient wanted) it is the plain forward.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable

import torch
import torch.utils.checkpoint

from actorcore.errors import PatchNotAppliedError
from actorcore.hf.call import DecoderCall, TraceRef
from actorcore.hf.features.base import DecoderFeature, patch_trace_bound
from actorcore.hf.features.instance_forwards import install_forwards, wrapped_forward
from actorcore.hf.features.plan import FeatureOption, PlanFacts

NORM_FORWARD_KEY = "recompute_norms:forward"
NORM_RUN_KEY = "recompute_norms:run"

_NORM_SUFFIXES = ("RMSNorm", "LayerNorm")


def is_norm(module: torch.nn.Module) -> bool:
    """A per-token norm: torch's own, or a model's ``...RMSNorm`` / ``...LayerNorm`` leaf module."""
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return True
    return type(module).__name__.endswith(_NORM_SUFFIXES) and not any(True for _ in module.children())


class RecomputedNormForward:
    """The instance ``forward`` of a norm: its forward under a non-reentrant checkpoint when gradients flow."""

    def __init__(self, norm: torch.nn.Module, previous: Callable | None, trace: TraceRef) -> None:
        self.norm = norm
        self.previous = previous  # an instance forward that was there before, else None (the class's)
        self.trace = trace  # the patch's trace slot: the call's trace inside actorcore's calls, else None

    @torch.compiler.disable  # inside a fused (compiled) layer the recomputed norm runs as it is
    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        counts = self.trace.counts
        if counts is not None:
            counts[NORM_FORWARD_KEY] += 1
        run = functools.partial(self._run, counts)  # the recomputation in backward counts in the same trace
        if not (torch.is_grad_enabled() and (hidden_states.requires_grad or
                                             any(p.requires_grad for p in self.norm.parameters()))):
            return run(hidden_states, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(run, hidden_states, *args, use_reentrant=False,
                                                 preserve_rng_state=False, **kwargs)  # a norm draws nothing

    def _run(self, counts: Counter | None, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if counts is not None:
            counts[NORM_RUN_KEY] += 1
        return wrapped_forward(self.norm, self.previous)(hidden_states, *args, **kwargs)


def decoder_norms(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """Every per-token norm of the decoder (its layers' norms, per-head query/key norms, the final norm)."""
    return [module for module in decoder.modules() if is_norm(module)]


def install_recomputed_norms(norms: list[torch.nn.Module], trace: TraceRef
                             ) -> tuple[list[RecomputedNormForward], Callable[[], None]]:
    """Install a ``RecomputedNormForward`` on each norm; returns them and the function that restores the norms."""

    def make(norm: torch.nn.Module, previous: Callable | None) -> RecomputedNormForward:
        if isinstance(previous, RecomputedNormForward):
            raise ValueError(f"{type(norm).__name__} already recomputes in backward (another actorcore patch); "
                             "revert it first")
        return RecomputedNormForward(norm, previous, trace)

    return install_forwards(norms, make)


class RecomputeNorms(FeatureOption):
    """``recompute_norms``: True or False."""

    name = "recompute_norms"
    keywords = {"recompute_norms": False}
    doc = ("True: the decoder's norms keep only their input for backward and run again there (transformers' RMSNorm "
           "otherwise keeps an fp32 copy of its input and its normalised values: 16 GiB per norm at 512K tokens of "
           "an 8B model); bitwise the same results.")

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        on = asked["recompute_norms"]
        if not isinstance(on, bool):
            raise ValueError(f"recompute_norms must be True or False, got {on!r}")
        if not on:
            return self.decision(asked, False, "not asked")
        norms = decoder_norms(facts.parts.decoder)
        if not norms:
            raise ValueError(f"recompute_norms=True: found no norm module in {facts.model_name}'s decoder (none "
                             "named ...RMSNorm / ...LayerNorm); pass recompute_norms=False")
        return self.decision(asked, True, f"the decoder's {len(norms)} norms keep only their input for backward")


class RecomputedNorms(DecoderFeature):
    """``patch_model(recompute_norms=True)``: the norms' forwards for the patch's lifetime; ``check`` requires one
    forward per norm of the decoder in every call."""

    name = "recompute_norms"
    options = (RecomputeNorms(),)

    def in_batch_invariant_call(self, decided: Any) -> str:
        return ("recompute_norms=True and batch_invariant=True do not combine (both replace the norms' forward for "
                "the call); patch without recompute_norms for batch-invariant calls")

    def install(self, handle: Any) -> None:
        if handle.state.value("recompute_norms"):
            handle.add_undo(install_recomputed_norms(decoder_norms(handle.parts.decoder), handle.state.trace)[1])

    def active(self, call: DecoderCall) -> bool:
        return call.patch is not None and call.patch.value("recompute_norms")

    def enter(self, call: DecoderCall) -> Any:
        return patch_trace_bound(call)

    def check(self, call: DecoderCall) -> None:
        ran, norms = call.ran(NORM_FORWARD_KEY), len(decoder_norms(call.parts.decoder))
        if ran < norms:
            raise PatchNotAppliedError(
                f"actorcore patch did not take effect in {call.model_name}: recomputed norms ran {ran} times for "
                f"{norms} modules. The installed transformers bypassed them; refusing to continue unpatched")
