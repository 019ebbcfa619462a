"""actorcore: the model layer for RL on LLMs and VLMs.

The top level is the contract of DESIGN.md, imported lazily: ``import actorcore`` loads neither transformers nor
megatron. Weight export lives in ``actorcore.export``, the Megatron-Core route in ``actorcore.mcore``, the pure
batch functions in ``actorcore.batch``, every error class in ``actorcore.errors``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # data
    "PackedBatch": "actorcore.batch",
    "pack": "actorcore.hf.packing",
    "pack_padded": "actorcore.hf.packing",
    "unpack": "actorcore.batch",
    # HF-route calls and their results
    "compute_logprobs": "actorcore.hf.logprobs",
    "compute_values": "actorcore.hf.logprobs",
    "compute_loss": "actorcore.hf.loss",
    "compute_logprobs_padded": "actorcore.hf.padded",
    "LogProbOutput": "actorcore.outputs",
    "LossOutput": "actorcore.outputs",
    # patching
    "patch_model": "actorcore.hf.patch",
    "PatchHandle": "actorcore.hf.patch",
    "ParallelContext": "actorcore.parallel",
    # checks and the registry
    "verify": "actorcore.hf.verify",
    "VerifyReport": "actorcore.hf.verify",
    "register_arch": "actorcore.hf.register",
    "get_spec": "actorcore.archs",
    "registered_model_types": "actorcore.archs",
    # the head on its own
    "linear_logprob_entropy": "actorcore.kernels.logprob",
    "linear_logprob_loss": "actorcore.kernels.logprob",
    # the errors a caller of the above catches (the others: actorcore.errors)
    "UnsupportedArchitectureError": "actorcore.errors",
    "VerificationError": "actorcore.errors",
    "NonFiniteError": "actorcore.errors",
    "FastPathNotRunError": "actorcore.errors",
}

# Names the top level had before; they keep working for one release with a DeprecationWarning naming the new
# place. name -> (module it is read from, what to write instead).
_DEPRECATED = {
    **{name: ("actorcore.export", f"actorcore.export.{name}") for name in (
        "hf_weight_stream", "load_into", "load_into_vllm", "load_into_sglang", "save_sharded_safetensors",
        "broadcast_stream", "BlockwiseFP8", "quantize_fp8_blockwise", "dequantize_fp8_blockwise", "ipc_send",
        "ipc_receive", "TransportError")},
    **{name: ("actorcore.batch", f"actorcore.batch.{name}") for name in (
        "pad_to_multiple", "next_token_labels", "shard_for_sp", "grid_to_packed", "packed_to_grid")},
    **{name: ("actorcore.context_split", f"actorcore.context_split.{name}") for name in ("split_for_cp", "CpShard")},
    "release_offload_buffers": ("actorcore.hf.features.offload", "actorcore.hf.features.offload.release_offload_buffers"),
    "pack_multimodal": ("actorcore.hf.vlm.packing", "actorcore.pack(sequences, multimodal=..., model=...)"),
    "pack_multimodal_padded": ("actorcore.hf.vlm.packing",
                               "actorcore.pack_padded(input_ids, attention_mask, model=..., **processor_outputs)"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _DEPRECATED:
        module, instead = _DEPRECATED[name]
        warnings.warn(f"actorcore.{name} is deprecated and leaves the top level in the next release; use "
                      f"{instead}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'actorcore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
