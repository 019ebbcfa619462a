"""Tiled MLP (``patch_model(tiled_mlp_shards=N)``): each decoder layer's MLP runs its forward shard by shard.

Each MLP gets, for the patch's lifetime, an instance ``forward``: a ``TiledMLPForward`` object holding its module
(not a closure over it, so a deep copy of the model runs the copy's MLP) that runs the original forward through
``kernels.tiled_mlp``. In actorcore's calls it counts ``tiled_mlp:forward`` in the call's trace (through the
patch's trace slot); the ``TiledMLP`` feature requires one per decoder layer, so a transformers version that
bypasses it raises ``PatchNotAppliedError`` instead of training unpatched.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from actorcore.archs import submodule
from actorcore.archs.support import tiled_mlp_refusal
from actorcore.errors import PatchNotAppliedError
from actorcore.hf.call import DecoderCall, TraceRef
from actorcore.hf.features.base import DecoderFeature, patch_trace_bound
from actorcore.hf.features.instance_forwards import install_forwards, wrapped_forward
from actorcore.hf.features.plan import FeatureOption, PlanFacts
from actorcore.kernels.tiled_mlp import tiled_mlp

TILED_MLP_KEY = "tiled_mlp:forward"


class TiledMLPForward:
    """The instance ``forward`` of a tiled MLP: its original forward over token shards."""

    def __init__(self, mlp: torch.nn.Module, shards: int, previous: Callable | None, trace: TraceRef) -> None:
        self.mlp = mlp
        self.shards = shards
        self.previous = previous  # an instance forward that was there before, else None (the class's)
        self.trace = trace  # the patch's trace slot: the call's trace inside actorcore's calls, else None

    @torch.compiler.disable  # inside a fused (compiled) layer the tiled MLP runs as it is
    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.trace.counts is not None:
            self.trace.counts[TILED_MLP_KEY] += 1
        plain = wrapped_forward(self.mlp, self.previous)
        # Parameters as registered now: under FSDP2, the unsharded ones its pre-forward hook installed.
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        return tiled_mlp(plain, hidden_states, self.shards, params)


class TiledMLPShards(FeatureOption):
    """``tiled_mlp_shards``: None (off) or the number of token shards each MLP runs over."""

    name = "tiled_mlp_shards"
    keywords = {"tiled_mlp_shards": None}
    off_value = None
    doc = ("each decoder layer's MLP runs its forward over this many token shards, recomputed per shard in backward "
           "(long sequences: the MLP's intermediate activations one shard at a time); None (default) leaves it. "
           "Refused for MoE models.")

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        shards = asked["tiled_mlp_shards"]
        if shards is None:
            return self.decision(asked, None, "not asked")
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"tiled_mlp_shards must be a positive int or None, got {shards!r}")
        why = tiled_mlp_refusal(facts.spec)
        if why:
            raise ValueError(f"tiled MLP does not support {facts.spec.model_type}: {why}; pass tiled_mlp_shards=None "
                             "(Ulysses SP alone works for MoE models)")
        layers = range(len(facts.parts.layers))
        return self.decision(asked, shards, f"every layer's MLP over {shards} token shards", layers)


class TiledMLP(DecoderFeature):
    """The tiled MLP forwards for the patch's lifetime; ``check`` requires one per decoder layer in every call."""

    name = "tiled_mlp"
    options = (TiledMLPShards(),)

    def install(self, handle: Any) -> None:
        shards = handle.state.value("tiled_mlp_shards")
        if shards is None:
            return
        mlps = [submodule(layer, handle.spec.mlp) for layer in handle.parts.layers]
        trace = handle.state.trace
        _, restore = install_forwards(mlps, lambda mlp, previous: TiledMLPForward(mlp, shards, previous, trace))
        handle.add_undo(restore)

    def active(self, call: DecoderCall) -> bool:
        return call.patch is not None and call.patch.value("tiled_mlp_shards") is not None

    def enter(self, call: DecoderCall) -> Any:
        return patch_trace_bound(call)

    def check(self, call: DecoderCall) -> None:
        ran, mlps = call.ran(TILED_MLP_KEY), len(call.parts.layers)
        if ran < mlps:
            raise PatchNotAppliedError(
                f"actorcore patch did not take effect in {call.model_name}: tiled MLP ran {ran} times for {mlps} "
                "modules. The installed transformers bypassed it; refusing to continue unpatched")
