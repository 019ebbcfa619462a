"""Context-parallel split of a packed batch: pure index functions (no communication).

Megatron's load-balanced layout: every segment of the batch (each sequence, and a trailing padding segment)
is padded at its end to a multiple of ``2 * cp`` and cut into ``2 * cp`` equal chunks; rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r`` of every segment, concatenated segment by segment. Under causal
attention the early chunk is cheap and the late one expensive, so every rank does the same work.
The padding added to a segment comes after its real tokens, so causal attention keeps it out of them.

Legend: ``T`` tokens of the batch, ``P`` tokens after per-segment padding, ``L`` one rank's tokens (``P / cp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from actorcore.batch import IGNORE_INDEX, PackedBatch, next_token_labels


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} of size {cp_size} is not valid (need 0 <= rank < size)")


def cp_padded_bounds(bounds: Sequence[int], cp_size: int, total: int | None = None) -> list[int]:
    """Segment offsets after padding every segment to a multiple of ``2 * cp_size``.

    ``total``: pad further, with one more segment, to this many tokens (a multiple of ``2 * cp_size``,
    at least the padded count): pipeline stages need the same token count for every micro-batch.
    """
    multiple = 2 * cp_size
    out = [0]
    for start, end in zip(bounds[:-1], bounds[1:]):
        out.append(out[-1] + -(-(end - start) // multiple) * multiple)
    if total is not None and total != out[-1]:
        if total % multiple or total < out[-1]:
            raise ValueError(f"cannot pad {out[-1]} context-parallel tokens to {total}: the total must be a "
                             f"multiple of 2*cp={multiple} and at least {out[-1]}")
        out.append(total)
    return out


def cp_chunk_index(padded_bounds: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[L]`` int64: the padded-layout index of each token rank ``cp_rank`` holds (chunks r and 2cp-1-r)."""
    _check_cp(cp_size, cp_rank)
    parts = []
    for start, end in zip(padded_bounds[:-1], padded_bounds[1:]):
        chunk = (end - start) // (2 * cp_size)
        if (end - start) % (2 * cp_size):
            raise ValueError(f"segment [{start}, {end}) is not a multiple of 2*cp={2 * cp_size}")
        for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + j * chunk, start + (j + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def cp_gather_order(padded_bounds: Sequence[int], cp_size: int) -> torch.Tensor:
    """``[P]`` int64: where each padded-layout token sits in the rank-order concatenation of every rank's
    ``[L]`` tensor (what an all-gather over the CP group returns); ``gathered[order]`` is the padded layout."""
    held = torch.cat([cp_chunk_index(padded_bounds, cp_size, r) for r in range(cp_size)])
    order = torch.empty_like(held)
    order[held] = torch.arange(held.numel())
    return order


def cp_local_positions(padded_bounds: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[L]`` int64: the position within its segment of each token rank ``cp_rank`` holds (what RoPE and the
    causal mask see)."""
    index = cp_chunk_index(padded_bounds, cp_size, cp_rank)
    starts = torch.as_tensor(padded_bounds[:-1], dtype=torch.int64)
    segment = torch.bucketize(index, torch.as_tensor(padded_bounds[1:], dtype=torch.int64), right=True)
    return index - starts[segment]


def _take(values_T: torch.Tensor, source: torch.Tensor, fill: float | int) -> torch.Tensor:
    picked = values_T[source.clamp(min=0)]
    keep = (source >= 0).view(-1, *([1] * (values_T.dim() - 1)))
    return torch.where(keep, picked, torch.full((), fill, dtype=values_T.dtype, device=values_T.device))


@dataclass(frozen=True)
class CpShard:
    """One CP rank's share of a packed batch, and how to put the per-token results of all ranks back.

    ``source`` ``[L]``: the batch token each local token is (-1 at added padding); ``merge_index`` ``[T]``:
    where each batch token sits in the rank-order concatenation of every rank's ``[L]`` results.
    ``labels`` are the batch's next-token labels taken before the split, so a chunk's last token is scored
    against the true next token held by another rank.
    """

    cp_size: int
    cp_rank: int
    padded_bounds: tuple[int, ...]
    source: torch.Tensor
    merge_index: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The padded layout's segment offsets ``[S + 1]`` int32 (Megatron's ``cu_seqlens_q_padded``)."""
        return torch.tensor(self.padded_bounds, dtype=torch.int32, device=self.input_ids.device)

    @property
    def max_seqlen(self) -> int:
        return max(b - a for a, b in zip(self.padded_bounds[:-1], self.padded_bounds[1:]))

    @property
    def num_tokens(self) -> int:
        """All tokens of the padded layout (every rank holds ``num_tokens / cp_size``)."""
        return self.padded_bounds[-1]

    def take(self, values_T: torch.Tensor, fill: float | int) -> torch.Tensor:
        """This rank's ``[L, ...]`` share of per-token values of the batch, ``fill`` at added padding."""
        return _take(values_T, self.source, fill)

    def merge(self, gathered: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` in the batch's token order from the rank-order concatenation ``[cp * L, ...]``."""
        return gathered[self.merge_index]


def split_for_cp(batch: PackedBatch, cp_size: int, cp_rank: int, total: int | None = None,
                 pad_token_id: int = 0) -> CpShard:
    """Rank ``cp_rank``'s share of ``batch`` under context parallelism ``cp_size`` (see the module docstring).

    ``total``: the padded token count to reach (a multiple of ``2 * cp_size``), for equal micro-batches.
    """
    _check_cp(cp_size, cp_rank)
    if batch.position_ids.dim() != 1:
        raise ValueError("context parallelism takes text batches with 1-D position ids (M-RoPE / VLM batches are "
                         "not supported)")
    bounds = [int(b) for b in batch.cu_seqlens.tolist()]
    padded = cp_padded_bounds(bounds, cp_size, total)
    device = batch.device
    # Batch token -> padded-layout index.
    segment = torch.repeat_interleave(torch.arange(len(bounds) - 1),
                                      torch.as_tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])]))
    shift = torch.as_tensor(padded[: len(bounds) - 1], dtype=torch.int64) - torch.as_tensor(bounds[:-1])
    padded_of_token = torch.arange(bounds[-1]) + shift[segment]
    token_of_padded = torch.full((padded[-1],), -1, dtype=torch.int64)
    token_of_padded[padded_of_token] = torch.arange(bounds[-1])
    source = token_of_padded[cp_chunk_index(padded, cp_size, cp_rank)]
    merge_index = cp_gather_order(padded, cp_size)[padded_of_token]
    source, merge_index = source.to(device), merge_index.to(device)
    labels_T, _ = next_token_labels(batch)
    positions = cp_local_positions(padded, cp_size, cp_rank).to(device=device, dtype=batch.position_ids.dtype)
    return CpShard(cp_size=cp_size, cp_rank=cp_rank, padded_bounds=tuple(padded), source=source,
                   merge_index=merge_index, input_ids=_take(batch.input_ids, source, pad_token_id),
                   position_ids=positions, labels=_take(labels_T, source, IGNORE_INDEX))
