"""The protocol of a decoder feature: one object that enters a packed decoder call and checks afterwards that it ran.

A feature is what the packed pass does besides running the Hugging Face decoder (packed attention, linear
attention, activation offload, batch-invariant tiles, VLM inputs, finite checks, tiled MLP, recomputed norms,
...). The pass (``hf.decoder.run_decoder``) runs, for one ``DecoderCall`` (``hf.call``):

    active = [f for f in DECODER_FEATURES if f.active(call)]
    with every f.enter(call), in list order:    # outermost first
        call.hidden = decoder(**call.kwargs)
    for f in active: f.check(call)              # raises a FastPathNotRunError subclass if f did not run

and ``patch_model`` resolves every feature's options into the patch's plan (``hf.features.plan``), then calls
``f.install(handle)`` of every feature once, for what lives as long as the patch.

How to add a feature:
1. Write a ``DecoderFeature`` subclass in a module of ``hf/features/``, with a ``name`` and the trace keys it
   counts (``"<area>:<what>"``; document them in its module).
2. Its option (if ``patch_model`` takes one): a ``plan.FeatureOption`` in its ``options``, with the keywords and
   defaults, ``resolve`` (check the value with a ``ValueError`` saying what to pass; the ``"auto"`` rule from the
   ``PlanFacts`` and the decisions it ``needs``; the layers or modules it targets; why) and the ``Conflict`` s it
   declares with other options. ``patch_model`` then takes its keywords, shows its decision in ``handle.plan`` and
   refuses or yields on a conflict; ``patch_model``'s docstring lists its ``doc``.
3. ``active(call)``: whether it runs in this call (a call option, its decision: ``call.patch.value(option)``,
   ``call.spec``). ``after``: the features it enters after. ``in_batch_invariant_call``: whether a batch-invariant
   call runs it, stands it down (``call.standing_down``) or is refused.
4. ``enter(call)``: a context manager around the decoder forward. It may add decoder keyword arguments
   (``call.kwargs``), install per-instance forwards on modules for this call (``instance_forwards``;
   ``switched_for_call`` keeps them in force for activation checkpointing's recomputation in backward), or wrap
   the forward in any context.
5. ``install(handle)`` (optional): per-instance forwards for the patch's lifetime, with their undo added to the
   handle (``handle.add_undo``); read its decision from ``handle.state`` (``value`` / ``targets``). Such forwards
   are called with the hidden states only, so they count into the patch's trace slot (``handle.state.trace.counts``,
   None outside actorcore's calls); the feature's ``enter`` returns ``patch_trace_bound(call)``, which points the
   slot at the call's trace for the forward and its recomputation.
6. ``check(call)``: after the forward, compare ``call.ran(key)`` with what must have run (e.g. one count per
   layer) and raise the feature's ``actorcore.errors.FastPathNotRunError`` subclass with what ran, what was
   expected, and the likely cause.
7. Add the object to ``hf.features.DECODER_FEATURES``, and test it per token against an independent reference,
   with a negative control: a bypassed feature raises its error (``tests/unit/test_decoder_features.py`` has an
   example feature with an option, an ``"auto"`` rule and a conflict).
Features hold no per-call state: everything of a call lives on the ``DecoderCall``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from actorcore.hf.call import DecoderCall, TraceRef
from actorcore.hf.features.plan import after_their_dependencies


class DecoderFeature:
    """One feature of the packed decoder pass (see the module docstring). The defaults do nothing."""

    name = "feature"
    options: tuple = ()  # its patch_model options (hf.features.plan.FeatureOption objects)
    after: tuple[str, ...] = ()  # the features (names) it enters after: their contexts are outside its own

    def in_batch_invariant_call(self, decided: Any) -> str:
        """What a batch-invariant call does with this feature when its options are on (``decided``: the plan's
        decisions by option): ``plan.RUNS``, ``plan.STANDS_DOWN`` (the model's own code runs for the call), or why
        such a call is refused."""
        return "runs"

    def install(self, handle: Any) -> None:
        """At ``patch_model``: install what lives as long as the patch (``handle.add_undo`` for its undo)."""

    def active(self, call: DecoderCall) -> bool:
        return False

    def enter(self, call: DecoderCall) -> contextlib.AbstractContextManager:
        """The context the decoder forward runs in (entered in ``DECODER_FEATURES`` order)."""
        return contextlib.nullcontext()

    def check(self, call: DecoderCall) -> None:
        """After the forward: raise a ``FastPathNotRunError`` subclass unless the trace shows the feature ran."""


def entry_order(features: Any) -> tuple["DecoderFeature", ...]:
    """The features in the order they enter a call: the given order, moved only where a feature declares that it
    enters ``after`` another listed later (stable); a name no feature has, or a cycle, is an error."""
    return tuple(after_their_dependencies(list(features), lambda f: f.after, "decoder features"))


@contextlib.contextmanager
def switched_for_call(decoder: torch.nn.Module, switch: Callable[[], Any]) -> Iterator[None]:
    """Enter ``switch()`` (a context manager factory) for one forward, including the recomputation in backward.

    With activation checkpointing, layers are re-run during backward, after this context has exited. The
    checkpoint functions (Hugging Face's per-layer ``_gradient_checkpointing_func``, and torch's
    ``checkpoint_wrapper``'s ``checkpoint_fn``) are wrapped, per instance and for this forward, so that the
    recomputation runs under the same switch and sees the same modules as the original forward.
    """
    wrapped = []
    for module in decoder.modules():
        for attr in _checkpoint_function_attrs(module):
            original = module.__dict__[attr]
            setattr(module, attr, _recompute_under(original, switch))
            wrapped.append((module, attr, original))
    try:
        with switch():
            yield
    finally:
        for module, attr, original in wrapped:
            setattr(module, attr, original)


def _checkpoint_function_attrs(module: torch.nn.Module) -> list[str]:
    """Instance attributes holding the function that (re)runs a checkpointed layer."""
    attrs = []
    if module.__dict__.get("_gradient_checkpointing_func") is not None and getattr(module, "gradient_checkpointing",
                                                                                   False):
        attrs.append("_gradient_checkpointing_func")
    if "checkpoint_fn" in module.__dict__ and hasattr(module, "_checkpoint_wrapped_module"):
        attrs.append("checkpoint_fn")
    return attrs


def _recompute_under(checkpoint_fn: Any, switch: Callable[[], Any]) -> Any:
    def checkpoint_with_switch(fn: Any, *args: Any, **kwargs: Any) -> Any:
        def switched(*a: Any, **k: Any) -> Any:
            with switch():
                return fn(*a, **k)

        return checkpoint_fn(switched, *args, **kwargs)

    return checkpoint_with_switch


@contextlib.contextmanager
def _bound(slot: TraceRef, counts: Any, standing_down: frozenset) -> Iterator[None]:
    previous = slot.counts, slot.standing_down
    slot.counts, slot.standing_down = counts, standing_down
    try:
        yield
    finally:
        slot.counts, slot.standing_down = previous


def patch_trace_bound(call: DecoderCall) -> Any:
    """The patch's trace slot pointed at the call's trace (and the features standing down in it), for the forward
    and its recomputation."""
    return switched_for_call(call.parts.decoder, functools.partial(_bound, call.patch.trace, call.trace,
                                                                   call.standing_down))
