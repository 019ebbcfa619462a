"""Log-prob/entropy from one shard of the lm-head's vocabulary rows, without any collective.

Shape suffixes: T tokens, D hidden, V vocab rows of this shard.

The shard reduces to per-token statistics; the caller's ``reduce_stats`` turns them into the whole
vocabulary's (``actorcore.parallel.vocab_parallel`` merges them over a tensor-parallel group), so the
kernel layer issues no collectives. Backward returns this shard's partial grad_hidden (the caller
all-reduces it, as Megatron's column-parallel linear does) and the grad of its own weight rows.
"""

from __future__ import annotations

from collections import Counter

import torch

from actorcore.kernels.logprob._common import check_inputs
from actorcore.kernels.logprob.api import BACKENDS, select_engine
from actorcore.kernels.logprob.function import LinearLogprobEntropyFunction, ReduceStats


def linear_logprob_entropy_vocab_shard(
    hidden_TD: torch.Tensor,
    weight_shard_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    vocab_start: int,
    reduce_stats: ReduceStats | None,
    temperature: float = 1.0,
    entropy: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
    softcap: float | None = None,
    trace: Counter[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprob/entropy from the vocabulary rows starting at ``vocab_start``.

    ``labels_T`` are global vocabulary ids. ``reduce_stats((m, s, a, zy))`` must return the statistics
    of the whole vocabulary (None: the shard is the whole vocabulary). ``trace``: as in
    ``linear_logprob_entropy``.
    """
    valid = tuple(b for b in BACKENDS if b != "reference")
    if backend not in valid:
        raise ValueError(f"unknown backend {backend!r} for the vocab-parallel head; valid: {', '.join(valid)}")
    if not (isinstance(vocab_start, int) and vocab_start >= 0):
        raise ValueError(f"vocab_start must be a non-negative int, got {vocab_start!r}")
    if reduce_stats is not None and not callable(reduce_stats):
        raise ValueError(f"reduce_stats must be None or callable, got {type(reduce_stats).__name__}")
    check_inputs(
        hidden_TD,
        weight_shard_VD,
        labels_T,
        temperature=temperature,
        softcap=softcap,
        chunk_size=chunk_size,
        entropy=entropy,
        trace=trace,
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
        reduce_stats,
        trace,
    )
