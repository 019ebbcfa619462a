"""Rollout engines fed from the trainer: a bridge per engine that makes a weight update exact or loud, and the
trainer-engine agreement of a rollout's log-probs. vLLM is imported only by what runs it."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "VllmBridge": "actorcore.engines.vllm",
    "EngineUpdate": "actorcore.engines.vllm",
    "WORKER_EXTENSION": "actorcore.engines.vllm_worker",
    "TESTED_VLLM": "actorcore.engines.vllm_worker",
    "ProbeResult": "actorcore.engines.probe",
    "Agreement": "actorcore.engines.agreement",
    "rollout_agreement": "actorcore.engines.agreement",
    "EngineUpdateError": "actorcore.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actorcore.engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
