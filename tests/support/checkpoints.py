"""Reading an HF checkpoint directory back in tests, whichever way it was written (one file or sharded)."""

from __future__ import annotations

import json
import os

import torch


def load_checkpoint_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors``, or of the shards ``model.safetensors.index.json`` names (each name
    must be in the shard the index says, and in no other)."""
    from safetensors.torch import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(directory, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        for name, tensor in load_file(os.path.join(directory, shard)).items():
            assert name not in tensors and weight_map.get(name) == shard, f"{name} in {shard}: not where the index says"
            tensors[name] = tensor
    assert sorted(tensors) == sorted(weight_map), set(tensors) ^ set(weight_map)
    return tensors
