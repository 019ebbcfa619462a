"""Read the pickled parts of a Megatron distributed checkpoint without running code from it.

torch's checkpoint reader unpickles ``.metadata`` with plain ``pickle`` and megatron-core ``torch.load``s
``common.pt``; a crafted file would run arbitrary code. ``check_checkpoint_pickles`` reads them first: the
metadata with an unpickler that builds only the classes torch's DCP writes there (its metadata and plan
dataclasses, ``torch.Size``, dtypes, layouts, a path), ``common.pt`` with ``torch.load(weights_only=True)``. Anything
else is refused before the library reader opens the directory. (The checkpoint's byte items, unpickled by
torch with ``weights_only=False``, are never requested: see ``dist_checkpoint.load_mcore_checkpoint``.)
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from actorcore.errors import CheckpointError
from actorcore.errors import UnsafeCheckpointError  # noqa: F401 (re-exported)

# Every global a DCP ``.metadata`` written by torch 2.x / megatron-core 0.16 refers to.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},  # StorageMeta.checkpoint_id when torch's writer saved it
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), _TORCH_VALUES)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}")


def read_dcp_metadata(path: str) -> Any:
    """The ``Metadata`` object of a ``.metadata`` file, built without calling anything but the allowed classes."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the Megatron checkpoint is incomplete") from None
    except Exception as exc:  # noqa: BLE001 - unpickling raises many types on crafted or damaged input
        raise UnsafeCheckpointError(f"{path}: refused, it is not plain checkpoint metadata ({exc}); a checkpoint "
                                    "never needs this: do not load it") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: refused, it holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


def check_checkpoint_pickles(directory: str) -> Any:
    """Validate every pickled file the library reader will open, and that every data file the metadata names
    stays inside ``directory`` (``actorcore.model_files``); returns the ``.metadata`` content."""
    for name in sorted(os.listdir(directory)):
        if name.endswith(".metadata") and name != ".metadata":  # per-rank metadata of other torch versions
            read_dcp_metadata(os.path.join(directory, name))
    metadata = read_dcp_metadata(os.path.join(directory, ".metadata"))
    from actorcore.model_files import allowed_roots, model_file

    roots = allowed_roots(directory)
    for info in (getattr(metadata, "storage_data", None) or {}).values():  # the data files the reader opens
        model_file(directory, str(getattr(info, "relative_path", "")), roots)
    common = os.path.join(directory, "common.pt")
    if os.path.exists(common):
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - the weights-only unpickler raises several types
            raise UnsafeCheckpointError(f"{common}: refused, it is not plain data ({str(exc).splitlines()[0]}); "
                                        "do not load it") from None
    return metadata


def tensor_dtypes(metadata: Any, exempt: Any = lambda key: False) -> set[torch.dtype]:
    """The dtypes of the tensors a checkpoint's metadata lists (its bytes items aside), those whose key ``exempt``
    accepts left out when float32."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {m.properties.dtype for key, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and not (m.properties.dtype == torch.float32 and exempt(key))}
