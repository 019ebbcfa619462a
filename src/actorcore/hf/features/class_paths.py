"""Paths installed per module for the patch's lifetime, and the check that every installed module took the path in
a call: by class (quack's gated MLP runs as a subclass of its own class put in front of it) or through transformers'
``ExpertsInterface`` (the MoE experts: ``moe_experts``).

A class, not an instance ``forward``: the compiled decoder compiles one layer forward for all layers of a class, and
Dynamo guards on the identity of what a layer calls; one object per module recompiled the layer for every layer
(and past Dynamo's recompile limit, ran it uncompiled). Each installed module holds the patch's trace slot in its
``__dict__`` (a deep copy of the model is a copy of those modules); nothing per module is read inside a compiled
layer (the MoE experts' config copy is one object for all layers). Compiled layers run only inside actorcore's
calls, so there the path is taken without reading the slot (``is_compiling``): eager runs count into the call's
trace, compiled ones are proven by the compiled decoder's own count (``modules_that_ran``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from actorcore.errors import PatchNotAppliedError
from actorcore.hf.call import DecoderCall, TraceRef
from actorcore.hf.features.base import DecoderFeature, patch_trace_bound
from actorcore.hf.features.compiled_decoder import compiled_layers
from actorcore.hf.features.plan import STANDS_DOWN

TRACE_ATTR = "_actorcore_path_trace"  # the patch's trace slot, on each installed module


def install_each(modules: list[torch.nn.Module], trace: TraceRef,
                 put: Callable[[torch.nn.Module], Callable[[], None]]) -> Callable[[], None]:
    """Give each module the trace slot and put it on the path (``put(module)`` returns that module's undo); returns
    the undo of all, last first."""
    installed: list[tuple[torch.nn.Module, Callable[[], None]]] = []

    def restore() -> None:
        for module, undo in reversed(installed):
            undo()
            module.__dict__.pop(TRACE_ATTR, None)
        installed.clear()

    for module in modules:
        module.__dict__[TRACE_ATTR] = trace
        installed.append((module, put(module)))
    return restore


def install_classes(modules: list[torch.nn.Module], trace: TraceRef, class_for: Callable[[type], type]
                    ) -> Callable[[], None]:
    """Run each module as ``class_for(its class)`` holding the trace slot; returns the undo."""

    def put(module: torch.nn.Module) -> Callable[[], None]:
        base = module.__class__
        module.__class__ = class_for(base)
        return lambda: setattr(module, "__class__", base)

    return install_each(modules, trace, put)


def class_in_front(path_class: type, base: type, **attrs: Any) -> type:
    """``base``'s class with ``path_class`` in front (named as ``base``, ``_actorcore_base`` pointing at it): one per
    module class, so the compiled decoder's one compiled layer serves every layer (cache it per ``base``)."""
    return type(base.__name__, (path_class, base), {
        "_actorcore_base": base, "__module__": base.__module__, "__qualname__": base.__qualname__, **attrs})


def reduce_to_path_class(module: torch.nn.Module, make_class: Callable[..., type], *args: Any) -> tuple:
    """``__reduce_ex__`` of a module of a path class: pickled (``torch.save``) and deep-copied as an empty instance of
    ``make_class(*args)`` (a module-level function, pickled by name) given the module's state; the class itself is made
    at run time under its base's name, which pickle cannot look up."""
    return _path_instance, (make_class, args), module.__getstate__()


def _path_instance(make_class: Callable[..., type], args: tuple) -> Any:
    return object.__new__(make_class(*args))


def counted_call(module: torch.nn.Module, key: str, feature: str) -> bool:
    """Whether this forward of an installed module takes the path (counting it under ``key`` when eager): inside
    a compiled layer always, eager only inside actorcore's calls (the trace slot bound) where ``feature`` does not
    stand down (a batch-invariant call runs the model's own code)."""
    if torch.compiler.is_compiling():
        return True
    trace = module.__dict__.get(TRACE_ATTR)  # None: a module no patch installed the path on
    if trace is None or trace.counts is None or feature in trace.standing_down:
        return False
    trace.counts[key] += 1
    return True


def modules_that_ran(call: DecoderCall, names: tuple[str, ...], key: str,
                     bypassed: Callable[[torch.nn.Module], str | None]) -> tuple[int, dict[str, str]]:
    """``(how many of the installed modules ran the path, {name: why} of those no longer on it)``: counted by their
    eager runs under ``key``, or lying inside a layer the compiled decoder ran compiled; ``bypassed(module)`` says
    why a module no longer takes the path (None: it does)."""
    decoder, fused = call.parts.decoder, compiled_layers(call)
    in_fused = names_inside(decoder, [call.parts.layers[i] for i in sorted(fused)], names) if fused else set()
    reasons = {name: bypassed(decoder.get_submodule(name)) for name in names}
    return call.ran(key) + len(in_fused), {name: why for name, why in reasons.items() if why is not None}


def names_inside(decoder: torch.nn.Module, layers: list[torch.nn.Module], names: tuple[str, ...]) -> set[str]:
    """Those of ``names`` (submodules of the decoder) that lie inside one of ``layers`` (by their dotted prefixes:
    a few lookups per name each call, not a walk over every module)."""
    ids = {id(layer) for layer in layers}

    def inside(name: str) -> bool:
        parts = name.split(".")
        return any(id(decoder.get_submodule(".".join(parts[:n]))) in ids for n in range(1, len(parts)))

    return {name for name in names if inside(name)}


class ModulePathFeature(DecoderFeature):
    """A decoder feature whose modules (its decision's targets: names in the decoder) take its path for the patch's
    lifetime (``install_path``); ``check`` requires each of them to have run the path in the call (a
    batch-invariant call stands it down)."""

    key: str  # the trace key of their eager runs
    what: str  # the path and its modules, for the error: "quack's gated MLP ran in {ran} of {n} MLP modules"

    def install_path(self, modules: list[torch.nn.Module], state: Any) -> Callable[[], None]:
        """Put the modules on the path (each holding ``state.trace`` under ``TRACE_ATTR``); returns the undo."""
        raise NotImplementedError

    def bypassed(self, module: torch.nn.Module, state: Any) -> str | None:
        """Why an installed module no longer takes the path (None: it does)."""
        raise NotImplementedError

    def in_batch_invariant_call(self, decided: Any) -> str:
        return STANDS_DOWN  # its kernels are not proven row-count invariant: the model's own code, invariant linears

    def install(self, handle: Any) -> None:
        names = handle.state.targets(self.name)
        if names:
            modules = [handle.parts.decoder.get_submodule(name) for name in names]
            handle.add_undo(self.install_path(modules, handle.state))

    def active(self, call: DecoderCall) -> bool:
        return (call.patch is not None and bool(call.patch.targets(self.name))
                and self.name not in call.standing_down)

    def enter(self, call: DecoderCall) -> Any:
        return patch_trace_bound(call)

    def check(self, call: DecoderCall) -> None:
        names = call.patch.targets(self.name)
        ran, bypassed = modules_that_ran(call, names, self.key, lambda module: self.bypassed(module, call.patch))
        if bypassed or ran < len(names):
            why = ("; ".join(f"{name}: {reason}" for name, reason in bypassed.items()) if bypassed else
                   "the others did not run it (the installed transformers or another patch bypassed them)")
            raise PatchNotAppliedError(
                self.what.format(ran=min(ran, len(names) - len(bypassed)), n=len(names))
                + f" of {call.model_name}: {why}; refusing to continue on another path")


class ClassPathFeature(ModulePathFeature):
    """A feature whose modules run as ``class_for(state)(their class)`` for the patch's lifetime; a module no longer
    of ``path_class`` is bypassed."""

    path_class: type  # the class every installed module's class derives from

    def class_for(self, state: Any) -> Callable[[type], type]:
        raise NotImplementedError

    def install_path(self, modules: list[torch.nn.Module], state: Any) -> Callable[[], None]:
        return install_classes(modules, state.trace, self.class_for(state))

    def bypassed(self, module: torch.nn.Module, state: Any) -> str | None:
        if isinstance(module, self.path_class):
            return None
        return (f"{type(module).__name__} no longer runs as its path's class (the installed transformers or another "
                "patch put another class in)")
