"""Pure tensor transforms between HF and Megatron layouts, and tensor-/expert-parallel slicing.

No collectives, no I/O. Sharding is applied to each HF part *before* merging (a Megatron rank holds
``[gate_r; up_r]``, not a contiguous slice of ``[gate; up]``); for QKV both orders agree because the fused
layout is grouped by query group.
"""

from __future__ import annotations

import torch


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF q [N*H, ...], k [K*H, ...], v [K*H, ...] -> Megatron [K * (N/K + 2) * H, ...] grouped per query group."""
    groups = num_query_groups
    q_g = q.reshape(groups, -1, *q.shape[1:])
    k_g = k.reshape(groups, -1, *k.shape[1:])
    v_g = v.reshape(groups, -1, *v.shape[1:])
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, num_heads: int, num_query_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``merge_qkv`` (head counts of this tensor, i.e. local counts for a TP shard)."""
    groups = num_query_groups
    per_group = num_heads // groups + 2
    head_dim = qkv.shape[0] // (groups * per_group)
    grouped = qkv.reshape(groups, per_group * head_dim, *qkv.shape[1:])
    q_rows = (per_group - 2) * head_dim
    q, k, v = torch.split(grouped, [q_rows, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def merge_gated_qkv(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """Gated attention (Qwen3-Next / Qwen3.5): HF ``q_proj`` holds ``[q_h; gate_h]`` per head ([N*2H, ...]);
    Megatron's ``attention_output_gate`` layout is ``[q of the group's heads; their gates; k; v]`` per query group."""
    groups = num_query_groups
    head_dim = k.shape[0] // groups  # k: one head per query group
    pairs = q_gate.reshape(groups, -1, 2, head_dim, *q_gate.shape[1:])  # [G, N/G, 2, H, ...]
    q_g = pairs[:, :, 0].reshape(groups, -1, *q_gate.shape[1:])
    gate_g = pairs[:, :, 1].reshape(groups, -1, *q_gate.shape[1:])
    k_g = k.reshape(groups, -1, *k.shape[1:])
    v_g = v.reshape(groups, -1, *v.shape[1:])
    return torch.cat([q_g, gate_g, k_g, v_g], dim=1).reshape(-1, *q_gate.shape[1:])


def split_gated_qkv(qkv: torch.Tensor, num_heads: int,
                    num_query_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``merge_gated_qkv`` (local head counts for a TP shard): ``(q_proj, k_proj, v_proj)``."""
    groups = num_query_groups
    per_group = num_heads // groups
    head_dim = qkv.shape[0] // (groups * (2 * per_group + 2))
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (2 * per_group + 2) * head_dim, *rest)
    q, gate, k, v = torch.split(grouped, [per_group * head_dim, per_group * head_dim, head_dim, head_dim], dim=1)
    q = q.reshape(groups, per_group, 1, head_dim, *rest)
    gate = gate.reshape(groups, per_group, 1, head_dim, *rest)
    q_gate = torch.cat([q, gate], dim=2).reshape(-1, *rest)
    return q_gate, k.reshape(-1, *rest), v.reshape(-1, *rest)


def shard_sections(tensor: torch.Tensor, sections: list[int], rank: int, size: int) -> torch.Tensor:
    """This TP rank's rows of a tensor made of ``sections`` along dim 0 (e.g. a Gated DeltaNet's ``[q; k; v]``
    channels): each section split evenly, the rank's slices concatenated in section order."""
    parts = torch.split(tensor, sections, dim=0)
    return torch.cat([p.narrow(0, *_start_len(p.shape[0], rank, size)) for p in parts], dim=0)


def unshard_sections(shards: list[torch.Tensor], sections: list[int]) -> torch.Tensor:
    """Inverse of ``shard_sections`` given every rank's rows in rank order."""
    local = [s // len(shards) for s in sections]
    per_rank = [torch.split(shard, local, dim=0) for shard in shards]
    return torch.cat([torch.cat([parts[i] for parts in per_rank], dim=0) for i in range(len(sections))], dim=0)


def _start_len(full: int, rank: int, size: int) -> tuple[int, int]:
    start, stop = tp_range(full, rank, size)
    return start, stop - start


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up


def merge_interleaved_gate_up(hf: torch.Tensor) -> torch.Tensor:
    """HF ``[..., 2F]`` with gate and up columns alternating (a weight ``[D, 2F]`` or a bias ``[2F]``) -> Megatron's
    fc1 ``[gate; up]`` on dim 0 (the weight as ``[2F, D]``)."""
    rows = hf.movedim(-1, 0)
    return torch.cat([rows[0::2], rows[1::2]], dim=0)


def split_interleaved_gate_up(fc1: torch.Tensor) -> torch.Tensor:
    """Inverse of ``merge_interleaved_gate_up``."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(fc1.shape).movedim(0, -1)


def merge_parts(transform: str, parts: list[torch.Tensor], *, num_heads: int, num_query_groups: int) -> torch.Tensor:
    if transform == "rename":
        return parts[0]
    if transform == "qkv":
        return merge_qkv(*parts, num_query_groups=num_query_groups)
    if transform == "gate_up":
        return merge_gate_up(*parts)
    if transform == "gated_qkv":
        return merge_gated_qkv(*parts, num_query_groups=num_query_groups)
    if transform == "transpose":
        return parts[0].transpose(0, 1)
    if transform == "interleaved_gate_up":
        return merge_interleaved_gate_up(parts[0])
    raise ValueError(f"unknown transform {transform!r}")


def split_parts(transform: str, tensor: torch.Tensor, *, num_heads: int, num_query_groups: int) -> list[torch.Tensor]:
    if transform == "rename":
        return [tensor]
    if transform == "qkv":
        return list(split_qkv(tensor, num_heads, num_query_groups))
    if transform == "gate_up":
        return list(split_gate_up(tensor))
    if transform == "gated_qkv":
        return list(split_gated_qkv(tensor, num_heads, num_query_groups))
    if transform == "transpose":
        return [tensor.transpose(0, 1)]
    if transform == "interleaved_gate_up":
        return [split_interleaved_gate_up(tensor)]
    raise ValueError(f"unknown transform {transform!r}")


def tp_dim(parallel: str) -> int | None:
    """Tensor dimension split over TP ranks for a parallel style (None: not split)."""
    return {"column": 0, "vocab": 0, "row": 1}.get(parallel)


def tp_range(full: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s equal slice of a dimension of length ``full``."""
    if full % size:
        raise ValueError(f"dimension of length {full} cannot be split evenly over {size} tensor-parallel ranks")
    step = full // size
    return rank * step, (rank + 1) * step


def shard_for_tp(tensor: torch.Tensor, parallel: str, rank: int, size: int, padded_rows: int | None = None) -> torch.Tensor:
    """This TP rank's slice. ``vocab``: rows padded with zeros to ``padded_rows`` first."""
    if parallel == "vocab" and padded_rows is not None and padded_rows != tensor.shape[0]:
        tensor = pad_vocab(tensor, padded_rows)
    dim = tp_dim(parallel)
    if dim is None or size == 1:
        return tensor
    start, stop = tp_range(tensor.shape[dim], rank, size)
    return tensor.narrow(dim, start, stop - start)


def unshard_for_tp(shards: list[torch.Tensor], parallel: str, vocab_size: int | None = None) -> torch.Tensor:
    """Inverse of ``shard_for_tp`` given every rank's slice in rank order (vocab padding removed)."""
    dim = tp_dim(parallel)
    full = shards[0] if dim is None else torch.cat(shards, dim=dim)
    if parallel == "vocab" and vocab_size is not None:
        full = full[:vocab_size]
    return full


def pad_vocab(tensor: torch.Tensor, padded_rows: int) -> torch.Tensor:
    if padded_rows < tensor.shape[0]:
        raise ValueError(f"padded vocabulary {padded_rows} is smaller than {tensor.shape[0]}")
    pad = tensor.new_zeros(padded_rows - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, pad], dim=0)


def local_experts(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Global indices of the experts an EP rank holds (contiguous blocks, as Megatron lays them out)."""
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {ep_size} expert-parallel ranks")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
