"""Packed (padding-free) batches: pure tensor-in, tensor-out functions.

Legend for shape suffixes: ``T`` tokens of the packed batch, ``B`` sequences, ``S`` padded length.

A packed batch concatenates every sequence; ``cu_seqlens`` marks where each starts. Padding added for
sequence parallelism (``pad_to_multiple``) forms one extra trailing segment of its own, so real tokens
never attend to it and it never attends to them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedBatch:
    """Sequences concatenated along one token axis.

    ``cu_seqlens`` has ``B + 1`` entries (plus one more when ``num_padding > 0``: the padding segment).
    ``position_ids`` is ``[T]`` for text models, ``[3, T]`` / ``[4, T]`` for M-RoPE models.
    ``multimodal`` holds per-batch vision inputs (concatenated in sequence order) for VLMs.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_padding: int = 0
    multimodal: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_packed(self)

    @property
    def num_tokens(self) -> int:
        """All tokens, padding included (the length of every ``[T]`` tensor)."""
        return int(self.input_ids.shape[-1])

    @property
    def num_real_tokens(self) -> int:
        return self.num_tokens - self.num_padding

    @property
    def num_sequences(self) -> int:
        """Real sequences (the padding segment is not one)."""
        return int(self.cu_seqlens.numel()) - 1 - (1 if self.num_padding else 0)

    @property
    def seq_lens(self) -> list[int]:
        bounds = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(bounds[: self.num_sequences], bounds[1 : self.num_sequences + 1])]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str) -> "PackedBatch":
        def move(x: Any) -> Any:
            return x.to(device) if isinstance(x, torch.Tensor) else x

        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            multimodal={k: move(v) for k, v in self.multimodal.items()},
        )


def check_packed(batch: PackedBatch) -> None:
    """A hand-built batch is checked like a packed one: shapes and dtypes always, and on the CPU the values
    of ``cu_seqlens`` (on a GPU reading them would synchronise on every construction)."""
    ids, cu, pos = batch.input_ids, batch.cu_seqlens, batch.position_ids
    for name, tensor in (("input_ids", ids), ("cu_seqlens", cu), ("position_ids", pos)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"PackedBatch.{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_meta:
            raise ValueError(f"PackedBatch.{name} is on the meta device (a shape without values): pack real token "
                             "ids (ac.pack / ac.pack_padded) and move the batch to the model's device with "
                             "batch.to(device)")
    _check_ids(ids, "PackedBatch.input_ids")
    if ids.dim() != 1:
        raise ValueError(f"PackedBatch.input_ids must be 1-D [T], got shape {tuple(ids.shape)}")
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"PackedBatch.cu_seqlens must be a 1-D int32/int64 tensor of B + 1 >= 2 offsets, got "
                         f"shape {tuple(cu.shape)} dtype {cu.dtype}; build batches with actorcore.pack")
    if pos.shape[-1] != ids.shape[0] or pos.dim() not in (1, 2):
        raise ValueError(f"PackedBatch.position_ids has shape {tuple(pos.shape)}; expected [{ids.shape[0]}] or "
                         f"[rows, {ids.shape[0]}]")
    if not isinstance(batch.num_padding, int) or batch.num_padding < 0:
        raise ValueError(f"PackedBatch.num_padding must be a non-negative int, got {batch.num_padding!r}")
    if cu.is_cuda:
        return
    bounds = cu.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != ids.shape[0] or min(lengths) < 1:
        raise ValueError(f"PackedBatch.cu_seqlens {bounds} must start at 0, increase strictly (no empty sequence) "
                         f"and end at the token count {ids.shape[0]}; build batches with actorcore.pack")
    if not isinstance(batch.max_seqlen, int) or batch.max_seqlen < max(lengths):
        raise ValueError(f"PackedBatch.max_seqlen={batch.max_seqlen!r} but the longest sequence has "
                         f"{max(lengths)} tokens")
    if batch.num_padding and lengths[-1] != batch.num_padding:
        raise ValueError(f"PackedBatch.num_padding={batch.num_padding} but the last segment has {lengths[-1]} "
                         "tokens: padding is its own trailing segment (pad_to_multiple)")


def _check_ids(ids: torch.Tensor, what: str) -> None:
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{what} must hold integer token ids, got dtype {ids.dtype}; convert with .long()")


def cu_seqlens_from_lengths(lengths: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as int32."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    if len(lengths):
        out[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int64), 0).to(device=device)
    return out


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position ids ``[T]`` restarting at 0 at every segment start."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def pack(sequences: Sequence[torch.Tensor]) -> PackedBatch:
    """Concatenate 1-D id tensors into one packed batch with per-sequence position ids (text models).

    ``actorcore.pack`` adds VLM inputs on top of this (``actorcore.hf.packing``).
    """
    if isinstance(sequences, torch.Tensor):
        raise ValueError("pack() takes a list of 1-D id tensors; for a padded [B, S] tensor use pack_padded()")
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__iter__"):
        raise ValueError(f"pack() takes a list of 1-D id tensors, got {type(sequences).__name__}")
    sequences = list(sequences)  # generators and other iterables too
    if len(sequences) == 0:
        raise ValueError("pack() got an empty list: pass at least one sequence of token ids")
    for i, ids in enumerate(sequences):
        _check_ids(ids, f"sequence {i}")
        if ids.dim() != 1:
            raise ValueError(f"sequence {i} has shape {tuple(ids.shape)}; each sequence must be a 1-D tensor of ids")
        if ids.numel() == 0:
            raise ValueError(f"sequence {i} is empty; drop zero-length sequences before packing")
    device = sequences[0].device
    lengths = [int(s.numel()) for s in sequences]
    input_ids = torch.cat([s.to(device=device, dtype=torch.long) for s in sequences])
    cu_seqlens = cu_seqlens_from_lengths(lengths, device=device)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=positions_from_cu_seqlens(cu_seqlens, input_ids.numel()),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths),
    )


def check_mask(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    mask = attention_mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must contain only 0 and 1")
    mask = mask.to(torch.long)
    lengths = mask.sum(-1)
    if bool((lengths == 0).any()):
        row = int((lengths == 0).nonzero()[0])
        raise ValueError(f"row {row} of attention_mask is all zeros: every sequence needs at least one token")
    # Holes: the ones of a row must be contiguous (left or right padding only).
    first = mask.argmax(-1)
    idx = torch.arange(mask.shape[-1], device=mask.device)
    contiguous = (idx >= first[:, None]) & (idx < (first + lengths)[:, None])
    if not bool((contiguous.long() == mask).all()):
        row = int((contiguous.long() != mask).any(-1).nonzero()[0])
        raise ValueError(
            f"row {row} of attention_mask has holes; only left- or right-padded rows (one contiguous run of 1s) "
            "can be packed"
        )
    return mask.bool()


def pack_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Pack a left- or right-padded ``[B, S]`` batch, dropping the padding (text models)."""
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"pack_padded() needs the [B, S] attention_mask of 0/1 (got {type(attention_mask).__name__}); "
                         "for rows without padding pass torch.ones_like(input_ids), or use pack() on a list of rows")
    _check_ids(input_ids, "input_ids")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)} is empty")
    mask = check_mask(attention_mask, input_ids)
    return pack([row[keep] for row, keep in zip(input_ids, mask)])


def unpack(values_T: torch.Tensor, batch: PackedBatch, padding_value: float = 0.0) -> torch.Tensor:
    """Per-token values ``[T, ...]`` -> right-padded ``[B, S_max, ...]`` (padding tokens dropped)."""
    if not isinstance(batch, PackedBatch):
        raise ValueError(f"unpack() takes the PackedBatch the values were computed on, got {type(batch).__name__}")
    if not isinstance(values_T, torch.Tensor) or values_T.dim() == 0:
        raise ValueError(f"unpack() takes per-token values [T, ...] (e.g. out.log_probs), got "
                         f"{'a 0-d tensor' if isinstance(values_T, torch.Tensor) else type(values_T).__name__}")
    if values_T.shape[0] not in (batch.num_tokens, batch.num_real_tokens):
        raise ValueError(
            f"values have {values_T.shape[0]} tokens but the batch has {batch.num_real_tokens} "
            f"(+{batch.num_padding} padding)"
        )
    lengths = batch.seq_lens
    out = values_T.new_full((len(lengths), max(lengths), *values_T.shape[1:]), padding_value)
    bounds = batch.cu_seqlens.tolist()
    for i, n in enumerate(lengths):
        out[i, :n] = values_T[bounds[i] : bounds[i] + n]
    return out


def grid_to_packed(values_BS: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S, ...]`` per-token values of a padded batch -> ``[T, ...]`` in the order ``pack_padded`` packs
    (row by row, real tokens only): how advantages, old log-probs or loss masks held in the input's grid reach
    ``compute_loss``'s ``token_args``."""
    mask = _grid_mask(values_BS, attention_mask)
    return values_BS[mask]


def packed_to_grid(values_T: torch.Tensor, attention_mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``[T, ...]`` per-token results -> ``[B, S, ...]`` in the padded input's own layout (left or right
    padding kept), ``fill`` at padding: ``grid[attention_mask.bool()] = values``."""
    mask = check_mask(attention_mask, attention_mask) if isinstance(attention_mask, torch.Tensor) else None
    if mask is None:
        raise ValueError(f"attention_mask must be a [B, S] tensor of 0/1, got {type(attention_mask).__name__}")
    if values_T.dim() == 0 or values_T.shape[0] != int(mask.sum()):
        raise ValueError(f"values have shape {tuple(values_T.shape)} but the mask holds {int(mask.sum())} tokens")
    grid = values_T.new_full((*mask.shape, *values_T.shape[1:]), fill)
    grid[mask.to(values_T.device)] = values_T
    return grid


def _grid_mask(values_BS: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    if not isinstance(values_BS, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
        raise ValueError("grid_to_packed takes [B, S] tensors: the values and the attention_mask")
    if tuple(values_BS.shape[:2]) != tuple(attention_mask.shape):
        raise ValueError(f"values of shape {tuple(values_BS.shape)} do not match the attention_mask "
                         f"{tuple(attention_mask.shape)} in their first two dims")
    return check_mask(attention_mask, attention_mask).to(values_BS.device)


def segment_ids(batch: PackedBatch) -> torch.Tensor:
    """``[T]`` index of the segment (sequence, or the padding segment) each token belongs to."""
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=batch.device), lengths,
                                   output_size=batch.num_tokens)


def sequence_start_mask(batch: PackedBatch) -> torch.Tensor:
    """``[T]`` bool, True at the first token of every segment."""
    starts = torch.zeros(batch.num_tokens, dtype=torch.bool, device=batch.device)
    starts[batch.cu_seqlens[:-1].long()] = True
    return starts


def next_token_labels(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels for the position that predicts each next token, never crossing a sequence boundary.

    Returns ``(labels_T, valid_T)``: ``labels_T[t] = input_ids[t + 1]`` when ``t + 1`` is in the same real
    sequence, else ``IGNORE_INDEX`` (last token of a sequence, and every padding token).
    """
    labels = torch.full_like(batch.input_ids, IGNORE_INDEX)
    labels[:-1] = batch.input_ids[1:]
    ends = batch.cu_seqlens[1:].long() - 1
    labels.index_fill_(0, ends, IGNORE_INDEX)  # the indexed assignment synchronised with the GPU (bench/host_syncs.py)
    if batch.num_padding:
        labels[batch.num_real_tokens :] = IGNORE_INDEX
    return labels, labels != IGNORE_INDEX


def shift_to_scored_token(predicting_T: torch.Tensor) -> torch.Tensor:
    """Move values from the predicting position ``t`` to the scored token ``t + 1``; 0 at position 0.

    Combined with ``next_token_labels`` (which zeroes cross-sequence predictions), every sequence's first
    token ends up 0.
    """
    out = torch.zeros_like(predicting_T)
    out[1:] = predicting_T[:-1]
    return out


def shift_to_predicting(scored_T: torch.Tensor, valid_T: torch.Tensor) -> torch.Tensor:
    """Per-token rows in the scored-token layout (row t belongs to token t, ``[T_real, ...]``) moved to the position
    that predicts each token (row t - 1), over the ``[T]`` positions of ``valid_T`` (``next_token_labels``'s, padding
    included): zeros where nothing is predicted (every sequence's last token, padding). What a head that works at the
    predicting positions needs of per-token inputs; ``shift_to_scored_token`` is the way back."""
    tokens = valid_T.shape[0]
    if scored_T.shape[0] > tokens:
        raise ValueError(f"{scored_T.shape[0]} rows for a batch of {tokens} tokens: pass one row per real token")
    out = scored_T.new_zeros((tokens, *scored_T.shape[1:]))
    if scored_T.shape[0] > 1:
        out[: scored_T.shape[0] - 1] = scored_T[1:]
    keep = valid_T.reshape(-1, *([1] * (scored_T.dim() - 1)))
    return torch.where(keep, out, torch.zeros_like(out))


def to_scored_tokens(predicting_T: torch.Tensor, valid_T: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Per-token results at the predicting positions, back in the scored-token layout ``[T_real]``: predictions
    that cross a sequence boundary zeroed (``valid_T`` of ``next_token_labels``), padding dropped, each value moved
    to the token it scored (0 at every sequence's first token)."""
    kept = torch.where(valid_T, predicting_T, torch.zeros_like(predicting_T))
    return shift_to_scored_token(unpad(kept, batch))


def pad_to_multiple(batch: PackedBatch, multiple: int, pad_token_id: int = 0) -> PackedBatch:
    """Append a padding segment so the token count is a multiple of ``multiple`` (no-op if it already is)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if batch.num_padding:
        raise ValueError("batch is already padded; pad the unpadded batch once")
    extra = (-batch.num_tokens) % multiple
    if extra == 0:
        return batch
    device = batch.device
    pos = batch.position_ids
    pad_pos = torch.arange(extra, device=device, dtype=pos.dtype)
    if pos.dim() == 2:
        pad_pos = pad_pos.expand(pos.shape[0], extra)
    cu = torch.cat([batch.cu_seqlens, batch.cu_seqlens.new_tensor([batch.num_tokens + extra])])
    return dataclasses.replace(
        batch,
        input_ids=torch.cat([batch.input_ids, batch.input_ids.new_full((extra,), pad_token_id)]),
        position_ids=torch.cat([pos, pad_pos], dim=-1),
        cu_seqlens=cu,
        max_seqlen=max(batch.max_seqlen, extra),
        num_padding=extra,
    )


def unpad(values_T: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Drop the padding segment's values from a ``[T, ...]`` tensor."""
    return values_T[: batch.num_real_tokens]


def shard_bounds(total: int, sp_rank: int, sp_size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``sp_rank``'s contiguous shard of ``total`` tokens (``total % sp_size == 0``)."""
    if total % sp_size:
        raise ValueError(f"{total} tokens do not split over sp_size={sp_size}; pad_to_multiple() first")
    size = total // sp_size
    return sp_rank * size, (sp_rank + 1) * size


def shard_for_sp(x: torch.Tensor, sp_rank: int, sp_size: int, dim: int = -1) -> torch.Tensor:
    """Rank ``sp_rank``'s contiguous shard of ``x`` along its token dimension ``dim``."""
    start, end = shard_bounds(x.shape[dim], sp_rank, sp_size)
    return x.narrow(dim, start, end - start)
