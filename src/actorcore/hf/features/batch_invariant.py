"""Batch-invariant decoder passes (``compute_logprobs(..., batch_invariant=True)``): the same sequence gets
bitwise the same hidden states whatever it is packed with, wherever it sits, whatever the pack's token count.

Where a token's result could depend on the rest of the pack, and what this mode does about it:
- every ``nn.Linear`` of the decoder (matmul kernels are chosen by the row count): its instance ``forward`` is,
  for the call, an ``InvariantLinearForward`` running ``kernels.batch_invariant.tiled_linear`` on fixed-size row
  tiles;
- the norms (``...RMSNorm`` / ``...LayerNorm`` modules and torch's own; per-token, but their reduction's launch
  configuration depends on the row count): an ``InvariantRowsForward`` running them on fixed-size row tiles;
- attention is per sequence already (flash / varlen kernels tile each sequence from its own start and do not
  split the keys for queries longer than one token; the ``segments`` backend runs one call per sequence);
- rotary embeddings, activations, residual adds: element-wise (the rotary "matmul" has one term per output);
- the log-prob head: fixed-size chunks and a fixed vocabulary split (``kernels.logprob``, ``batch_invariant``).
MoE blocks (routing and per-expert matmuls whose row counts depend on the batch), hybrid linear attention and
vision towers are refused.

The forwards are installed per call and removed after it (also around activation checkpointing's
recomputation: ``hf.features.base.switched_for_call``); they are objects holding their module, not closures. Each
counts itself in the call's trace (``batch_invariant:linear``, ``batch_invariant:norm``).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any, Iterator

import torch

from actorcore.archs import ArchSpec
from actorcore.archs.support import batch_invariant_refusal
from actorcore.errors import BatchInvariantNotAppliedError  # noqa: F401 (re-exported)
from actorcore.hf.call import DecoderCall
from actorcore.hf.features.base import DecoderFeature, switched_for_call
from actorcore.hf.features.norm_recompute import RecomputedNormForward, is_norm
from actorcore.kernels.batch_invariant import NORM_TILE_ROWS, tiled_linear, tiled_rows

LINEAR_TRACE_KEY = "batch_invariant:linear"
NORM_TRACE_KEY = "batch_invariant:norm"


def check_batch_invariant_support(spec: ArchSpec) -> None:
    """Refuse what this mode does not make invariant, before any work."""
    why = batch_invariant_refusal(spec)
    if why:
        raise ValueError(f"batch_invariant=True does not support {spec.model_type}: {why}; call without "
                         "batch_invariant")


class InvariantLinearForward:
    """The instance ``forward`` of an ``nn.Linear`` for one call: ``tiled_linear`` with its own parameters."""

    def __init__(self, linear: torch.nn.Linear, tile_rows: int | None, trace: Counter, ran: set[int]) -> None:
        self.linear = linear
        self.tile_rows = tile_rows
        self.trace = trace
        self.ran = ran  # ids of the linears that ran invariant in the call

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        self.trace[LINEAR_TRACE_KEY] += 1
        self.ran.add(id(self.linear))
        return tiled_linear(input, self.linear.weight, self.linear.bias, self.tile_rows)


class InvariantRowsForward:
    """The instance ``forward`` of a per-token norm for one call: its class forward on fixed-size row tiles."""

    def __init__(self, norm: torch.nn.Module, tile_rows: int, trace: Counter) -> None:
        self.norm = norm
        self.tile_rows = tile_rows
        self.trace = trace

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise ValueError(f"batch_invariant=True: {type(self.norm).__name__} takes more than the hidden states "
                             "(e.g. a gate), which the mode does not cover; call without batch_invariant")
        self.trace[NORM_TRACE_KEY] += 1
        return tiled_rows(type(self.norm).forward.__get__(self.norm), hidden_states, self.tile_rows)


def invariant_modules(decoder: torch.nn.Module) -> tuple[list[torch.nn.Linear], list[torch.nn.Module]]:
    """The decoder's linears and norms, checked to run their class ``forward`` (nothing else replaced it)."""
    linears, norms = [], []
    for name, module in decoder.named_modules():
        if isinstance(module, torch.nn.Linear):
            if type(module).forward is not torch.nn.Linear.forward:
                raise ValueError(f"batch_invariant=True: {name} is a {type(module).__name__} with its own forward "
                                 "(e.g. a quantized linear), which the mode cannot make invariant")
            found = linears
        elif is_norm(module):
            found = norms
        else:
            continue
        if isinstance(module.__dict__.get("forward"), RecomputedNormForward):
            raise ValueError(f"batch_invariant=True: {name} recomputes in backward (patch_model(recompute_norms=True))"
                             "; the two do not combine: revert that patch and patch without recompute_norms")
        if "forward" in module.__dict__:
            raise ValueError(f"batch_invariant=True: {name} already has an instance forward (another patch); "
                             "the mode would replace it")
        found.append(module)
    return linears, norms


@contextlib.contextmanager
def _installed(linears: list, norms: list, tile_rows: int | None, norm_tile_rows: int, trace: Counter,
               ran: set[int]) -> Iterator[None]:
    """The invariant forwards on these modules for one forward (or one recomputation), then the class's again."""
    installed = []
    try:
        for module in linears:
            module.__dict__["forward"] = InvariantLinearForward(module, tile_rows, trace, ran)
            installed.append(module)
        for module in norms:
            module.__dict__["forward"] = InvariantRowsForward(module, norm_tile_rows, trace)
            installed.append(module)
        yield
    finally:
        for module in installed:
            module.__dict__.pop("forward", None)


def batch_invariant_decoder(decoder: torch.nn.Module, spec: ArchSpec, trace: Counter, tile_rows: int | None = None,
                            norm_tile_rows: int = NORM_TILE_ROWS, ran: set[int] | None = None) -> Any:
    """Context manager: the decoder's linears and norms run batch-invariant for one call (and its recomputation);
    ``tile_rows``: one tile height for every linear (``None``: each linear's ``linear_tile_rows``); ``ran``
    collects the ids of the linears that ran."""
    check_batch_invariant_support(spec)
    linears, norms = invariant_modules(decoder)
    ran = set() if ran is None else ran
    return switched_for_call(decoder, functools.partial(_installed, linears, norms, tile_rows, norm_tile_rows, trace,
                                                        ran))


class BatchInvariant(DecoderFeature):
    """``batch_invariant=True``: the invariant forwards for the call; ``check`` requires every linear of every
    decoder layer to have run invariant, else something ran other code (a bypassed forward, a path of another
    patch whose kernels are not proven invariant: the plan stands those down for the call)."""

    name = "batch_invariant"
    after = ("activation_offload",)

    def active(self, call: DecoderCall) -> bool:
        return call.batch_invariant

    def enter(self, call: DecoderCall) -> Any:
        ran = call.notes.setdefault(self.name, set())
        return batch_invariant_decoder(call.parts.decoder, call.spec, call.trace, ran=ran)

    def check(self, call: DecoderCall) -> None:
        ran = call.notes.get(self.name, set())
        linears = [(i, name) for i, layer in enumerate(call.parts.layers) for name, module in layer.named_modules()
                   if isinstance(module, torch.nn.Linear) and id(module) not in ran]
        if linears:
            i, name = linears[0]
            raise BatchInvariantNotAppliedError(
                f"batch-invariant linears did not run in {len(linears)} linears of {call.model_name}'s decoder layers "
                f"(first: layer {i}'s {name}): the installed transformers bypassed the modules' forward, or another "
                "path computed them; refusing to return results that are not batch-invariant")
