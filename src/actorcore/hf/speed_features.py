"""The fused decoder and the planned checkpointing of one decoder call, as one object the decoder enters.

``StepFeatures.for_call`` reads the patch (``PatchState``) and the call (training or not, batch-invariant, token
count); ``kwargs()`` are the decoder kwargs it adds, ``context()`` sets the layers' checkpointing for the call,
``check(trace, before)`` proves after the forward that the fused layers and the selective checkpoints ran
(``PatchNotAppliedError`` otherwise). ``checkpointed`` are the layers checkpointed in this call (activation
offload moves only their inputs).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from actorcore.archs import text_config
from actorcore.errors import PatchNotAppliedError
from actorcore.hf.checkpointing import check_selective_ran, checkpointing_for_call, plan_layer_modes
from actorcore.hf.fused_decoder import FUSED_KWARG, FUSED_TRACE_KEY
from actorcore.kernels.selective_checkpoint import SELECTIVE_TRACE_KEY

TRACE_KEYS = (FUSED_TRACE_KEY, SELECTIVE_TRACE_KEY)


@dataclass
class StepFeatures:
    model_name: str
    layers: list
    fused: tuple[int, ...]  # layers that run fused in this call
    modes: list[str] | None  # per-layer checkpointing of this call (None: the model's own)

    @classmethod
    def for_call(cls, model: Any, state: Any, layers: list, tokens: int, batch_invariant: bool) -> "StepFeatures":
        fused = () if state is None or batch_invariant else tuple(state.fused_layers)
        modes = None
        training = model.training and torch.is_grad_enabled()
        if state is not None and state.checkpointing is not None and training:
            param = next(model.parameters())
            allocated = torch.cuda.memory_allocated(param.device) if param.is_cuda else 0
            flags = [i in fused for i in range(len(layers))]
            config = text_config(model.config)
            modes = plan_layer_modes(state.checkpointing, flags, tokens, config, param.element_size(), allocated)
        return cls(type(model).__name__, list(layers), fused, modes)

    @property
    def checkpointed(self) -> list:
        if self.modes is None:
            return self.layers
        return [layer for layer, mode in zip(self.layers, self.modes) if mode != "none"]

    def kwargs(self) -> dict[str, Any]:
        return {FUSED_KWARG: True} if self.fused else {}

    def context(self, trace: Counter) -> Any:
        if self.modes is None:
            return contextlib.nullcontext()
        return checkpointing_for_call(self.layers, self.modes, trace)

    def check(self, trace: Counter, before: dict[str, int]) -> None:
        ran = trace[FUSED_TRACE_KEY] - before[FUSED_TRACE_KEY]
        if ran < len(self.fused):
            raise PatchNotAppliedError(
                f"the fused decoder ran in {ran} of {len(self.fused)} decoder layers of {self.model_name}: the "
                "installed transformers bypassed the layers' instance forward; refusing to continue unfused")
        if self.modes is not None:
            check_selective_ran(trace, before[SELECTIVE_TRACE_KEY], self.modes.count("selective"), self.model_name)
