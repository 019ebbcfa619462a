"""SP rows for ``actorcore demo``: Ulysses sequence parallelism on local gloo processes vs one process.

Every rank passes the same full packed batch (the SP contract) and gets the full ``[T]`` outputs back; the
rows report the largest per-token difference from the one-process packed result, over all ranks. The ranks run
on the embedded text model (``actorcore.hf.embedded``), spawned by ``actorcore.parallel.spawn``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest per-token |a - b|."""
    return (a.float() - b.float()).abs().max().item()


def timed(fn: Callable[[], Any], repeats: int = 3) -> tuple[Any, float]:
    """``fn()`` without gradients, and the best seconds of ``repeats`` calls after one untimed warm-up call
    (attention registration, kernel selection, allocator): every demo path is timed warm, and the best of a few
    calls is what a shared machine's other load disturbs least."""
    with torch.no_grad():
        out = fn()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - start)
    return out, best


def _sp_worker(rank: int, world_size: int, sequences: list[torch.Tensor], seed: int) -> list[dict]:
    import torch.distributed as dist

    import actorcore as ac
    from actorcore.hf.embedded import build_text_model

    ctx = ac.ParallelContext(sp_group=dist.new_group(list(range(world_size))))
    batch = ac.pack(sequences)
    actor = build_text_model(seed=seed)
    critic = build_text_model(seed=seed + 1, task="token_classification")
    with torch.no_grad():
        ref = ac.compute_logprobs(actor, batch)
        ref_values = ac.compute_values(critic, batch)

    rows = []
    for label, shards in ((f"ulysses sp={world_size} (gloo)", None),
                          (f"ulysses sp={world_size} + tiled MLP x2 (gloo)", 2)):
        actor_patch = ac.patch_model(actor, parallel=ctx, tiled_mlp_shards=shards)
        critic_patch = ac.patch_model(critic, parallel=ctx, tiled_mlp_shards=shards)
        out, seconds = timed(lambda: ac.compute_logprobs(actor, batch, parallel=ctx))
        values, _ = timed(lambda: ac.compute_values(critic, batch, parallel=ctx))
        actor_patch.revert()
        critic_patch.revert()
        rows.append({"path": label, "max_abs_diff_logprob": max_diff(out.log_probs, ref.log_probs),
                     "max_abs_diff_entropy": max_diff(out.entropy, ref.entropy),
                     "max_abs_diff_value": max_diff(values, ref_values), "seconds": seconds})
    return rows


def sp_rows(sequences: list[torch.Tensor], sp_size: int, seed: int) -> list[dict]:
    """Run compute_logprobs / compute_values under Ulysses SP on ``sp_size`` local gloo processes.

    Returns one row per SP variant: ``path``, ``max_abs_diff_logprob`` / ``_entropy`` / ``_value`` (max
    per-token |Δ| against the one-process packed result, over all ranks) and ``seconds`` (rank 0's SP
    log-prob call, warm). The actor and the critic are the embedded text model, seeded with ``seed``.
    """
    from actorcore.parallel.spawn import run_distributed

    sequences = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    per_rank = run_distributed(_sp_worker, sp_size, args=(sequences, seed))
    rows = []
    for i, row in enumerate(per_rank[0]):
        merged = dict(row)
        for key in ("max_abs_diff_logprob", "max_abs_diff_entropy", "max_abs_diff_value"):
            merged[key] = max(rank_rows[i][key] for rank_rows in per_rank)
        rows.append(merged)
    logger.info("SP rows: %s", rows)
    return rows
