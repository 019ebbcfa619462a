"""The only module of ``mcore/`` that issues collectives; every function takes its group explicitly."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_gather_tensor(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks), in group-rank order."""
    size = group_size(group)
    if size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return out


def all_gather_object(obj: Any, group: Any) -> list[Any]:
    size = group_size(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def broadcast_tensor(tensor: torch.Tensor, src_group_rank: int, group: Any) -> torch.Tensor:
    if group_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src_group_rank), group=group)
    return tensor
