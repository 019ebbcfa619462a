"""Megatron-Core route: config and weight conversion (TP/PP/EP), model building, packed forward.

Importing this package does not import megatron-core; the functions that need it import it lazily and
raise ``MegatronNotInstalledError`` with the install command when it is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "McoreParallel": "actorcore.mcore.parallel",
    "context_from_megatron": "actorcore.mcore.parallel",
    "CpuRuntime": "actorcore.mcore.cpu_runtime",
    "initialize_megatron": "actorcore.mcore.parallel",
    "hf_to_mcore_config": "actorcore.mcore.config",
    "mcore_to_hf_config": "actorcore.mcore.config",
    "gpt_model_args": "actorcore.mcore.config",
    "UnsupportedConfigError": "actorcore.mcore.config",
    "build_gpt_model": "actorcore.mcore.model",
    "McoreModel": "actorcore.mcore.handle",
    "checkpoint_expert_layout": "actorcore.mcore.load",
    "SequenceParallelTorchNorm": "actorcore.mcore.norm",
    "load_hf_into_mcore": "actorcore.mcore.load",
    "export_mcore_to_hf": "actorcore.mcore.weight_stream",
    "mcore_weight_stream": "actorcore.mcore.weight_stream",
    "gather_hf_state_dict": "actorcore.mcore.weight_stream",
    "save_mcore_checkpoint": "actorcore.mcore.dist_checkpoint",
    "load_mcore_checkpoint": "actorcore.mcore.dist_checkpoint",
    "CheckpointMismatchError": "actorcore.errors",
    "compute_logprobs": "actorcore.mcore.forward",
    "compute_values": "actorcore.mcore.forward",
    "mtp_loss": "actorcore.mcore.forward",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'actorcore.mcore' has no attribute {name!r}")
