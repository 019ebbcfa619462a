"""Every collective actorcore issues, over explicit groups.

The Ulysses ones are autograd functions built on ``all_to_all_single`` with equal splits, which gloo (CPU)
and NCCL both provide; the Megatron route's plain all-gathers and broadcast are at the end of the file.
The layout convention: a tensor whose leading dim is the group size, ``x[s]`` being the block exchanged
with rank ``s``. An all-to-all over that layout sends ``x[s]`` to rank ``s`` and puts what rank ``s`` sent
into ``out[s]``; it is its own adjoint, so its backward is the same all-to-all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from actorcore.kernels.logprob import merge_partial_stats


def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


def all_to_all_blocks(x_S: torch.Tensor, group: Any) -> torch.Tensor:
    """Exchange block ``x_S[s]`` with rank ``s`` (no autograd). ``x_S.shape[0]`` must be the group size."""
    size = _group_size(group)
    if x_S.shape[0] != size:
        raise ValueError(f"all_to_all_blocks needs a leading dim equal to the group size {size}, got "
                         f"{tuple(x_S.shape)}")
    x_S = x_S.contiguous()
    out = torch.empty_like(x_S)
    dist.all_to_all_single(out, x_S, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_S: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return all_to_all_blocks(x_S, group)

    @staticmethod
    def backward(ctx, grad_S: torch.Tensor):
        return all_to_all_blocks(grad_S, ctx.group), None


def all_to_all(x_S: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable block exchange (see the module docstring for the layout)."""
    return _AllToAll.apply(x_S, group)


def all_gather_blocks(local: torch.Tensor, group: Any) -> torch.Tensor:
    """``[size, *local.shape]``: every rank's ``local`` in rank order (no autograd)."""
    size = _group_size(group)
    return all_to_all_blocks(local.unsqueeze(0).expand(size, *local.shape), group)


def reduce_scatter_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum of every rank's ``x``, split along dim 0: rank ``r`` gets block ``r`` (no autograd).

    The sum runs in rank order on every rank, so the result is deterministic.
    """
    size = _group_size(group)
    if x.shape[0] % size:
        raise ValueError(f"reduce_scatter_sum: dim 0 ({x.shape[0]}) does not split over {size} ranks")
    received_S = all_to_all_blocks(x.reshape(size, x.shape[0] // size, *x.shape[1:]), group)
    out = received_S[0].clone()
    for s in range(1, size):
        out += received_S[s]
    return out


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 (rank order); the backward reduce-scatters (SUM) the incoming gradient. Used by
    Ulysses SP for its outputs and by CP for its keys and values."""

    @staticmethod
    def forward(ctx, local_T: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return torch.cat(all_gather_tensor(local_T, group))

    @staticmethod
    def backward(ctx, grad_T: torch.Tensor):
        return reduce_scatter_sum(grad_T, ctx.group), None


def gather_sp(local_T: torch.Tensor, ctx: Any) -> torch.Tensor:
    """All-gather this rank's ``[T / sp, ...]`` outputs along dim 0 into the full ``[T, ...]`` on every rank.

    Backward reduce-scatters (SUM) the incoming gradients: every rank computes the same loss on the full
    outputs, so each shard's gradient is ``sp`` times the single-process one, and the parameter gradients
    averaged over the SP group (as FSDP2/DDP do) equal the single-process gradients.
    """
    if ctx.sp_size == 1:
        return local_T
    return _GatherTokens.apply(local_T, ctx.sp_group)


def merge_vocab_stats(stats: tuple, group: Any) -> tuple:
    """Per-token log-sum-exp statistics ``(m, s, a or None, zy)`` of this rank's vocabulary shard -> those
    of the whole vocabulary, on every rank of ``group`` (no autograd; the log-prob kernel's ``reduce_stats``).

    One all-gather of the stacked statistics, then the kernel's merge in rank order (deterministic).
    """
    m_T, s_T, a_T, zy_T = stats
    parts = [m_T, s_T, zy_T] + ([] if a_T is None else [a_T])
    gathered_S = all_gather_blocks(torch.stack(parts), group)  # [size, 3 or 4, T]
    m_ST, s_ST, zy_ST = gathered_S[:, 0], gathered_S[:, 1], gathered_S[:, 2]
    a_ST = None if a_T is None else gathered_S[:, 3]
    return merge_partial_stats(m_ST, s_ST, a_ST, zy_ST)


# ---- Context parallelism (Megatron route): autograd all-gathers over the CP group. ----


class _GatherOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_L: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.length = dist.get_rank(group), local_L.shape[0]
        return torch.cat(all_gather_tensor(local_L, group))

    @staticmethod
    def backward(ctx, grad_P: torch.Tensor):
        return grad_P[ctx.rank * ctx.length:(ctx.rank + 1) * ctx.length].contiguous(), None


def gather_cp_key_values(local_L: torch.Tensor, group: Any) -> torch.Tensor:
    """Every CP rank's ``[L, ...]`` keys/values concatenated in rank order, ``[cp * L, ...]``, on every rank.

    Each rank's queries read every rank's keys, so the backward sums (reduce-scatters) the key/value
    gradients of all ranks onto the rank that holds them. One all-gather per layer (``cp_comm_type`` None or
    ``"all_gather"``; ``ring_cp_attention`` is the ring alternative).
    """
    return _GatherTokens.apply(local_L, group)


def gather_cp_outputs(local_L: torch.Tensor, group: Any) -> torch.Tensor:
    """Every CP rank's ``[L, ...]`` per-token results concatenated in rank order, ``[cp * L, ...]``.

    Every CP rank then computes the same loss on the same gathered results, so the backward keeps this
    rank's block of the (identical) incoming gradient: each rank's parameter gradients are its tokens'
    share, and their sum over the CP group is the whole batch's gradient. Megatron's schedule multiplies
    the loss by cp and its DDP averages over data x context parallel ranks, which restores that sum.
    """
    return _GatherOutputs.apply(local_L, group)


# ---- Plain collectives of the Megatron route (no autograd; a group of one, or no world, is a no-op). ----


def _size_or_one(group: Any) -> int:
    """The group's size; 1 when there is no world. A process group made outside the default world (the weight-sync
    group of a trainer and an engine's workers) answers for itself."""
    if _answers_for_itself(group):
        return group.size()
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _answers_for_itself(group: Any) -> bool:
    """A process group object (registered or standalone, e.g. ``ProcessGroupGloo(store, rank, size)``), not ``None``
    (the default world)."""
    return group is not None and callable(getattr(group, "size", None)) and callable(getattr(group, "rank", None))


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (also a process group made outside the default world)."""
    return group.rank() if _answers_for_itself(group) else dist.get_rank(group)


def all_gather_tensor(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks), in group-rank order."""
    size = _size_or_one(group)
    if size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return out


def all_gather_object(obj: Any, group: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order.

    Over NCCL torch stages the bytes on ``torch.cuda.current_device()``: call ``torch.cuda.set_device`` for
    the rank first (otherwise every rank uses GPU 0)."""
    size = _size_or_one(group)
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_tensor(tensor: torch.Tensor, src_group_rank: int, group: Any) -> torch.Tensor:
    """``tensor`` of group rank ``src_group_rank`` on every rank (in place); over NCCL it must be a CUDA tensor."""
    if _size_or_one(group) > 1:
        dist.broadcast(tensor, group=group, group_src=src_group_rank)
    return tensor


# ---- Weight export over a process group (no autograd). ----


def broadcast_bytes(data: bytes | None, src_group_rank: int, group: Any, device: torch.device | str = "cpu"
                    ) -> bytes:
    """``data`` of group rank ``src_group_rank`` on every rank (others pass ``None``): its length, then its bytes,
    staged on ``device`` (the rank's CUDA device over NCCL). Bytes, not pickles: nothing received runs code."""
    if _size_or_one(group) == 1:
        return data if data is not None else b""
    sending = group_rank(group) == src_group_rank
    length = torch.tensor([len(data) if sending else 0], dtype=torch.int64, device=device)
    broadcast_tensor(length, src_group_rank, group)
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if sending and length.item()
               else torch.empty(int(length.item()), dtype=torch.uint8, device=device))
    if payload.numel():
        broadcast_tensor(payload, src_group_rank, group)
    return bytes(payload.cpu().numpy().tobytes())


# ---- Context parallelism, ring exchange (Megatron route, cp_comm_type="p2p"). ----


class _RingPass:
    """One step of a ring: this rank's ``tensor`` goes to the next rank, the previous rank's arrives (async)."""

    def __init__(self, tensor: torch.Tensor, group: Any) -> None:
        size, rank = _group_size(group), dist.get_rank(group)
        self.sent, self.received = tensor.contiguous(), torch.empty_like(tensor)  # both alive until wait()
        ops = [dist.P2POp(dist.isend, self.sent, dist.get_global_rank(group, (rank + 1) % size), group),
               dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (rank - 1) % size), group)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, kv: torch.Tensor, blocks: Any, group: Any) -> torch.Tensor:
        size, rank = _group_size(group), dist.get_rank(group)
        out = lse = None
        current = kv.contiguous()
        for step in range(size):
            transfer = _RingPass(current, group) if step < size - 1 else None  # overlaps this step's compute
            block_out, block_lse = blocks.forward(q, current, (rank - step) % size)
            out, lse = (block_out, block_lse) if out is None else blocks.merge(out, lse, block_out, block_lse)
            if transfer is not None:
                current = transfer.wait()
        ctx.blocks, ctx.group = blocks, group
        ctx.save_for_backward(q, kv, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, kv, out, lse = ctx.saved_tensors
        blocks, group = ctx.blocks, ctx.group
        size, rank = _group_size(group), dist.get_rank(group)
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        current, grad_pass, grad_kv = kv, None, None
        for step in range(size):
            transfer = _RingPass(current, group) if step < size - 1 else None
            block_dq, block_dkv = blocks.backward(grad_out, q, current, out, lse, delta, (rank - step) % size)
            dq += block_dq
            # The key/value gradient travels with its block: add this rank's share to what the ranks before
            # it computed, pass it on; after ``size`` passes it is back on the rank that holds the block.
            grad_kv = block_dkv if grad_pass is None else grad_pass.wait() + block_dkv
            grad_pass = _RingPass(grad_kv, group)
            if transfer is not None:
                current = transfer.wait()
        return dq.to(q.dtype), grad_pass.wait().to(kv.dtype), None, None


def ring_cp_attention(q: torch.Tensor, kv: torch.Tensor, blocks: Any, group: Any) -> torch.Tensor:
    """This rank's queries attending to every CP rank's keys/values, passed around the ring one block at a time.

    ``kv`` is this rank's ``[L, ...]`` block; each step sends the block in hand to the next rank and receives
    the previous rank's while ``blocks.forward(q, kv_block, source_rank) -> (out, lse)`` (fp32) computes on
    the current one, and ``blocks.merge`` folds the partial softmaxes together. The backward circulates the
    blocks again with ``blocks.backward(grad, q, kv_block, out, lse, delta, source_rank) -> (dq, dkv)`` (merged
    ``out``, ``lse`` and ``delta = sum(grad * out)``), sending each block's accumulated key/value gradient along with
    it back to its owner. Only one other rank's block is held at a time (plus the one in flight).
    """
    return _RingAttention.apply(q, kv, blocks, group)
