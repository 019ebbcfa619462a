"""Vocabulary-parallel log-prob/entropy: the lm-head weight is sharded over a tensor-parallel group.

Shape suffixes: T tokens, D hidden, V vocab rows of this rank's shard.

The kernel (``linear_logprob_entropy_vocab_shard``) reduces this rank's shard to per-token statistics;
``collectives.merge_vocab_stats`` merges them over the group, so every rank returns the full-vocabulary
logprob and entropy.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch

from actorcore.kernels.logprob.vocab_shard import linear_logprob_entropy_vocab_shard
from actorcore.parallel.collectives import merge_vocab_stats


def linear_logprob_entropy_vocab_parallel(
    hidden_TD: torch.Tensor,
    weight_shard_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    vocab_start: int,
    tp_group: Any,
    temperature: float = 1.0,
    entropy: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
    softcap: float | None = None,
    trace: Counter[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full-vocabulary per-token logprob/entropy from a vocabulary shard starting at ``vocab_start``.

    ``labels_T`` are global vocabulary ids. Every rank of ``tp_group`` must call this with the same
    hidden states and labels. ``tp_group=None`` means the shard is the whole vocabulary. Backward gives
    this rank's partial grad_hidden: the caller all-reduces it over the group.
    """
    reduce_stats = None if tp_group is None else functools.partial(merge_vocab_stats, group=tp_group)
    return linear_logprob_entropy_vocab_shard(
        hidden_TD, weight_shard_VD, labels_T, vocab_start=vocab_start, reduce_stats=reduce_stats,
        temperature=temperature, entropy=entropy, backend=backend, chunk_size=chunk_size, softcap=softcap,
        trace=trace,
    )
