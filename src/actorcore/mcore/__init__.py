"""Megatron-Core route: model building, packed forward, and weight conversion (TP/PP/EP), one room per job:
``build/`` (HF config -> Megatron config and model, the modules actorcore puts in its layers), ``run/`` (per-token
outputs through Megatron's schedule) and ``convert/`` (HF checkpoints <-> sharded models, weight streams, Megatron
checkpoints); beside them what all three share: the parallel layout (``parallel``), the model handle (``handle``),
the CPU runtime (``cpu_runtime``) and the megatron-core probe (``_megatron``). The names below are the route's public
surface, imported from here. The module paths from before the rooms still import for one release, with a
DeprecationWarning: ``model``, ``config``, ``norm``, ``attention``, ``rotary`` (now in ``build/``), ``forward``
(``run/``), ``load``, ``weight_stream``, ``dist_checkpoint`` (``convert/``).

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
    "hf_to_mcore_config": "actorcore.mcore.build.config",
    "mcore_to_hf_config": "actorcore.mcore.build.config",
    "gpt_model_args": "actorcore.mcore.build.config",
    "UnsupportedConfigError": "actorcore.mcore.build.config",
    "build_gpt_model": "actorcore.mcore.build.model",
    "McoreModel": "actorcore.mcore.handle",
    "checkpoint_expert_layout": "actorcore.mcore.convert.load",
    "SequenceParallelTorchNorm": "actorcore.mcore.build.norm",
    "load_hf_into_mcore": "actorcore.mcore.convert.load",
    "export_mcore_to_hf": "actorcore.mcore.convert.weight_stream",
    "mcore_weight_stream": "actorcore.mcore.convert.weight_stream",
    "gather_hf_state_dict": "actorcore.mcore.convert.weight_stream",
    "save_mcore_checkpoint": "actorcore.mcore.convert.dist_checkpoint",
    "load_mcore_checkpoint": "actorcore.mcore.convert.dist_checkpoint",
    "CheckpointMismatchError": "actorcore.errors",
    "compute_logprobs": "actorcore.mcore.run.forward",
    "compute_loss": "actorcore.mcore.run.loss",
    "compute_values": "actorcore.mcore.run.forward",
    "mtp_loss": "actorcore.mcore.run.forward",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'actorcore.mcore' has no attribute {name!r}")
