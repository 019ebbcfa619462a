"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``) of actorcore-built models.

The checkpoint directory holds Megatron's sharded tensors (global shapes, loadable at any TP / PP / EP
layout) plus ``hf/``: the source HF config and tokenizer files, and ``actorcore.json``: what is needed to
rebuild the model (model type, vocabulary padding).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from actorcore.mcore.checkpoint import CheckpointError

META_FILE = "actorcore.json"
HF_DIR = "hf"
# Files of an HF model directory that are carried along (everything but the weights).
_HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def copy_hf_side_files(src: str, dst: str) -> None:
    """Config, generation config, tokenizer, chat template... (not the weights)."""
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(_HF_WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(dst, name))


def _sharded_state_dict(chunks: list[Any]) -> dict[str, Any]:
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_mcore_checkpoint(chunks: list[Any], directory: str, hf_dir: str, vocab_multiple: int) -> None:
    """Collective: every rank calls it with its chunks; rank 0 also writes the HF side files and metadata."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not filesystem_async.HAVE_PSUTIL and filesystem_async._process_memory.__module__ == filesystem_async.__name__:
        # Its forked writer calls psutil unconditionally and the save would then wait forever.
        raise ImportError("megatron-core's distributed checkpoint writer needs psutil: pip install psutil")
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(_sharded_state_dict(chunks), directory)
    if not dist.is_initialized() or dist.get_rank() == 0:
        copy_hf_side_files(hf_dir, os.path.join(directory, HF_DIR))
        meta = {"format": "actorcore-mcore/1", "model_type": chunks[0].actorcore_hf_config.model_type,
                "vocab_multiple": vocab_multiple}
        with open(os.path.join(directory, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)


def read_mcore_metadata(directory: str) -> tuple[dict[str, Any], Any]:
    """(actorcore metadata, HF config) of a checkpoint written by ``save_mcore_checkpoint``."""
    from transformers import AutoConfig

    meta_path = os.path.join(directory, META_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: not an actorcore Megatron checkpoint (no {META_FILE})") from None
    except ValueError as exc:
        raise CheckpointError(f"{meta_path}: damaged ({exc})") from None
    try:
        hf_config = AutoConfig.from_pretrained(os.path.join(directory, HF_DIR))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{directory}/{HF_DIR}: cannot read the HF config ({exc})") from None
    return meta, hf_config


def load_mcore_checkpoint(chunks: list[Any], directory: str) -> None:
    """Fill this rank's chunks from a distributed checkpoint (any saved layout). Collective."""
    from megatron.core import dist_checkpointing

    from torch.distributed.checkpoint.api import CheckpointException

    try:
        state = dist_checkpointing.load(_sharded_state_dict(chunks), directory)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - many types for damaged input
        # CheckpointException (a BaseException) carries each rank's traceback; its last line is the cause.
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        message = (lines[-1] if isinstance(exc, CheckpointException) else lines[0]).strip() if lines else type(exc).__name__
        raise CheckpointError(f"{directory}: cannot load the Megatron checkpoint ({message})") from None
    if len(chunks) == 1:
        chunks[0].load_state_dict(state, strict=False)
        _check_loaded(chunks[0], state)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{i}"], strict=False)
            _check_loaded(chunk, state[f"model{i}"])


def _check_loaded(chunk: Any, state: dict[str, Any]) -> None:
    missing = [k for k in chunk.state_dict() if not k.endswith("_extra_state") and k not in state]
    if missing:
        raise CheckpointError(f"the Megatron checkpoint lacks {', '.join(missing[:10])}")
