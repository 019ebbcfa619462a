"""actorcore: the model layer for RL on LLMs and VLMs.

Small public API, imported lazily: ``import actorcore`` loads neither transformers nor megatron.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "PackedBatch": "actorcore.batch",
    "pack": "actorcore.hf.packing",
    "pack_padded": "actorcore.hf.packing",
    "unpack": "actorcore.batch",
    "pad_to_multiple": "actorcore.batch",
    "next_token_labels": "actorcore.batch",
    "shard_for_sp": "actorcore.batch",
    "split_for_cp": "actorcore.context_split",
    "CpShard": "actorcore.context_split",
    "pack_multimodal": "actorcore.hf.vlm.packing",
    "pack_multimodal_padded": "actorcore.hf.vlm.packing",
    "compute_logprobs": "actorcore.hf.logprobs",
    "compute_logprobs_padded": "actorcore.hf.padded",
    "grid_to_packed": "actorcore.batch",
    "packed_to_grid": "actorcore.batch",
    "compute_values": "actorcore.hf.logprobs",
    "compute_loss": "actorcore.hf.loss",
    "LossOutput": "actorcore.kernels.logprob",
    "LogProbOutput": "actorcore.outputs",
    "linear_logprob_entropy": "actorcore.kernels.logprob",
    "linear_logprob_loss": "actorcore.kernels.logprob",
    "ParallelContext": "actorcore.parallel",
    "verify": "actorcore.hf.verify",
    "VerifyReport": "actorcore.hf.verify",
    "VerificationError": "actorcore.hf.verify",
    "patch_model": "actorcore.hf.patch",
    "PatchHandle": "actorcore.hf.patch",
    "release_offload_buffers": "actorcore.hf.features.offload",
    "get_spec": "actorcore.archs",
    "register_arch": "actorcore.hf.register",
    "registered_model_types": "actorcore.archs",
    "hf_weight_stream": "actorcore.export",
    "load_into": "actorcore.export",
    "load_into_vllm": "actorcore.export",
    "load_into_sglang": "actorcore.export",
    "save_sharded_safetensors": "actorcore.export",
    "broadcast_stream": "actorcore.export",
    "BlockwiseFP8": "actorcore.export",
    "quantize_fp8_blockwise": "actorcore.export",
    "dequantize_fp8_blockwise": "actorcore.export",
    "ipc_send": "actorcore.export",
    "ipc_receive": "actorcore.export",
    "TransportError": "actorcore.export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actorcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
