"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``) of actorcore-built models.

The checkpoint directory holds Megatron's sharded tensors (global shapes, loadable at any TP / PP / EP
layout) plus ``hf/``: the source HF config and tokenizer files, and ``actorcore.json``: what is needed to
rebuild the model (model type, vocabulary padding, the number of MTP layers and the expert layout it was built
with).

Saving writes the shards in the calling process (``_InProcessSaveStrategy``): megatron-core's default writer
forks worker processes and a manager process, which a signal can kill while the parent waits on them for
ever. Loading never unpickles anything the checkpoint could have crafted (``safe_load``).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from actorcore.errors import CheckpointError, CheckpointMismatchError
from actorcore.mcore.convert import fault_points
from actorcore.mcore.handle import McoreModel, require_model

META_FILE = "actorcore.json"
HF_DIR = "hf"
# Files of an HF model directory that are carried along (everything but the weights).
_HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def copy_hf_side_files(src: str, dst: str) -> None:
    """Config, generation config, tokenizer, chat template... (not the weights).

    Every name goes through ``actorcore.model_files.model_file`` (the rule for every file of a model directory):
    a link resolving outside ``src`` (or a Hugging Face cache snapshot's repository folder) is refused, never
    copied.
    """
    from actorcore.model_files import allowed_roots, model_file

    os.makedirs(dst, exist_ok=True)
    roots = allowed_roots(src)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path) or name.endswith(_HF_WEIGHT_SUFFIXES):
            continue
        shutil.copyfile(os.path.realpath(model_file(src, name, roots)), os.path.join(dst, name))


def _sharded_state_dict(chunks: list[Any]) -> dict[str, Any]:
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    # The metadata GPTModel would default to, passed explicitly: 0.16.1's GPTModel reads ``metadata["dp_cp_group"]``
    # itself (for the MTP stage's embedding replica) before filling the default in.
    def sharded(chunk: Any) -> dict[str, Any]:
        return chunk.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))

    if len(chunks) == 1:
        return sharded(chunks[0])
    return {f"model{i}": sharded(chunk) for i, chunk in enumerate(chunks)}


def _in_process_save_strategy() -> Any:
    """megatron-core's ``torch_dist`` format, written by torch's synchronous ``FileSystemWriter`` in this
    process (no forked writers to be orphaned or waited on)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    class _InProcessSaveStrategy(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            sharded_state_dict, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica)
            state = mcore_torch.mcore_to_pyt_state_dict(sharded_state_dict, False)
            planner = mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                                   flatten_state_dict=False)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=planner)

    return _InProcessSaveStrategy("torch_dist", 1)


def save_mcore_checkpoint(model: McoreModel, directory: str, hf_dir: str) -> None:
    """Collective: every rank calls it with its model; rank 0 also writes the HF side files (from ``hf_dir``)
    and the metadata (the vocabulary padding, MTP layers and expert layout the model was built with)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    model = require_model(model, "save_mcore_checkpoint")
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(_sharded_state_dict(model.chunks), directory, sharded_strategy=_in_process_save_strategy())
    fault_points.reach("saving")
    if not dist.is_initialized() or dist.get_rank() == 0:
        copy_hf_side_files(hf_dir, os.path.join(directory, HF_DIR))
        meta = {"format": "actorcore-mcore/1", "model_type": model.hf_config.model_type,
                "vocab_multiple": model.vocab_multiple, "mtp_layers": model.mtp_layers,
                "expert_layout": model.expert_layout}
        with open(os.path.join(directory, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)


def read_mcore_metadata(directory: str) -> tuple[dict[str, Any], Any, Any]:
    """(actorcore metadata, HF config, dtype of the saved tensors) of a checkpoint written by
    ``save_mcore_checkpoint``. The dtype comes from the tensors (``.metadata``), not from the config."""
    from transformers import AutoConfig

    from actorcore.mcore.convert.safe_load import check_checkpoint_pickles, tensor_dtypes

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
    # What Megatron keeps in float32 whatever the model dtype (the router's expert bias) does not decide the dtype.
    from actorcore.mcore.build.model import mcore_spec_for

    spec = mcore_spec_for(hf_config)
    dtypes = tensor_dtypes(check_checkpoint_pickles(directory), exempt=spec.keeps_fp32_mcore) or {torch.float32}
    if len(dtypes) != 1:
        raise CheckpointError(f"{directory}: the checkpoint's tensors have dtypes {sorted(map(str, dtypes))}; "
                              "actorcore writes one dtype per checkpoint: this one was not written by it")
    return meta, hf_config, dtypes.pop()


def _tensors_only(sharded_state_dict: dict[str, Any]) -> dict[str, Any]:
    """The sharded state dict without its ``ShardedObject``s (the layers' empty ``_extra_state``): torch's
    reader would ``torch.load(weights_only=False)`` their bytes, i.e. run whatever a crafted file holds."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    _objects, tensors = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedObject))
    return tensors


def load_mcore_checkpoint(model: McoreModel, directory: str) -> None:
    """Fill this rank's model from a distributed checkpoint (any saved layout). Collective.

    The checkpoint's pickled files are validated first (``safe_load``) and no pickled object is loaded.
    """
    from megatron.core import dist_checkpointing

    from torch.distributed.checkpoint.api import CheckpointException

    from actorcore.mcore.convert.safe_load import check_checkpoint_pickles

    chunks = require_model(model, "load_mcore_checkpoint").chunks
    sharded = _tensors_only(_sharded_state_dict(chunks))
    _check_against_metadata(sharded, check_checkpoint_pickles(directory), directory)
    try:
        state = dist_checkpointing.load(sharded, directory)
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


def _check_against_metadata(sharded: dict[str, Any], metadata: Any, directory: str) -> None:
    """Name the tensors the model expects that the checkpoint lacks or holds in another global shape (what an
    edited ``hf/config.json`` causes), before megatron-core reports only the first one."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = metadata.state_dict_metadata
    problems = []
    for tensor in nested_values(sharded):
        if not isinstance(tensor, ShardedTensor):
            continue
        found = saved.get(tensor.key)
        if found is None:
            problems.append(f"missing tensor {tensor.key}")
        elif tuple(found.size) != tuple(tensor.global_shape):
            problems.append(f"tensor {tensor.key} has shape {list(found.size)}, the config builds "
                            f"{list(tensor.global_shape)}")
    if problems:
        raise CheckpointMismatchError(f"{directory}: its {HF_DIR}/config.json and its weights disagree (was the "
                                      f"config edited?): {'; '.join(sorted(set(problems)))}")


def _check_loaded(chunk: Any, state: dict[str, Any]) -> None:
    missing = [k for k in chunk.state_dict() if not k.endswith("_extra_state") and k not in state]
    if missing:
        raise CheckpointError(f"the Megatron checkpoint lacks {', '.join(missing[:10])}")
