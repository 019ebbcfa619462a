"""Vocabulary-parallel log-prob/entropy: the lm-head weight is sharded over a tensor-parallel group.

Shape suffixes: T tokens, D hidden, V vocab rows of this rank's shard.

Each rank reduces its shard to per-token statistics; ``_common.combine_vocab_stats`` (the only place
with collectives) merges them so every rank returns the full-vocabulary logprob and entropy. Backward
returns this rank's partial grad_hidden (the caller all-reduces it over the group, as Megatron's
column-parallel linear does) and the grad of its own weight shard.
"""

from __future__ import annotations

import torch

from actorcore.kernels.logprob._common import check_inputs
from actorcore.kernels.logprob.api import BACKENDS, select_engine
from actorcore.kernels.logprob.function import LinearLogprobEntropyFunction


def linear_logprob_entropy_vocab_parallel(
    hidden_TD: torch.Tensor,
    weight_shard_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    vocab_start: int,
    tp_group,
    temperature: float = 1.0,
    entropy: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full-vocabulary per-token logprob/entropy from a vocabulary shard starting at ``vocab_start``.

    ``labels_T`` are global vocabulary ids. Every rank of ``tp_group`` must call this with the same
    hidden states and labels. ``tp_group=None`` means the shard is the whole vocabulary.
    """
    valid = tuple(b for b in BACKENDS if b != "reference")
    if backend not in valid:
        raise ValueError(f"unknown backend {backend!r} for the vocab-parallel head; valid: {', '.join(valid)}")
    if not (isinstance(vocab_start, int) and vocab_start >= 0):
        raise ValueError(f"vocab_start must be a non-negative int, got {vocab_start!r}")
    check_inputs(
        hidden_TD,
        weight_shard_VD,
        labels_T,
        temperature=temperature,
        softcap=softcap,
        chunk_size=chunk_size,
        labels_in_range=False,
    )
    engine = select_engine(backend, hidden_TD)
    return LinearLogprobEntropyFunction.apply(
        hidden_TD,
        weight_shard_VD,
        labels_T - vocab_start,
        engine,
        float(temperature),
        None if softcap is None else float(softcap),
        bool(entropy),
        chunk_size,
        tp_group,
    )
