"""SP rows for ``actorcore demo``: Ulysses sequence parallelism on local gloo processes vs one process.

Every rank passes the same full packed batch (the SP contract) and gets the full ``[T]`` outputs back; the
rows report the largest per-token difference from the one-process packed result, over all ranks.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = fn()
    return out, time.perf_counter() - start


def _sp_worker(rank: int, world_size: int, model_type: str, sequences: list[torch.Tensor], seed: int) -> list[dict]:
    import torch.distributed as dist

    from actorcore.batch import pack
    from actorcore.hf.logprobs import compute_logprobs, compute_values
    from actorcore.hf.patch import patch_model
    from actorcore.parallel import ParallelContext
    from actorcore.testing.tiny_configs import build_tiny_model

    ctx = ParallelContext(sp_group=dist.new_group(list(range(world_size))))
    batch = pack(sequences)
    actor = build_tiny_model(model_type, seed=seed)
    critic = build_tiny_model(model_type, task="token_classification", seed=seed + 1)
    ref, _ = _timed(lambda: compute_logprobs(actor, batch))
    ref_values, _ = _timed(lambda: compute_values(critic, batch))

    rows = []
    for label, shards in ((f"ulysses sp={world_size} (gloo)", None),
                          (f"ulysses sp={world_size} + tiled MLP x2 (gloo)", 2)):
        actor_patch = patch_model(actor, parallel=ctx, tiled_mlp_shards=shards)
        critic_patch = patch_model(critic, parallel=ctx, tiled_mlp_shards=shards)
        out, seconds = _timed(lambda: compute_logprobs(actor, batch, parallel=ctx))
        values, _ = _timed(lambda: compute_values(critic, batch, parallel=ctx))
        actor_patch.revert()
        critic_patch.revert()
        rows.append({"path": label, "max_abs_diff_logprob": _max_diff(out.log_probs, ref.log_probs),
                     "max_abs_diff_entropy": _max_diff(out.entropy, ref.entropy),
                     "max_abs_diff_value": _max_diff(values, ref_values), "seconds": seconds})
    return rows


def sp_rows(model_type: str, sequences: list[torch.Tensor], sp_size: int, seed: int) -> list[dict]:
    """Run compute_logprobs / compute_values under Ulysses SP on ``sp_size`` local gloo processes.

    Returns one row per SP variant: ``path``, ``max_abs_diff_logprob`` / ``_entropy`` / ``_value`` (max
    per-token |Δ| against the one-process packed result, over all ranks) and ``seconds`` (rank 0's SP
    log-prob call). ``model_type`` names a tiny seeded config from ``actorcore.testing.tiny_configs``.
    """
    from actorcore.testing.distributed import run_distributed

    sequences = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    per_rank = run_distributed(_sp_worker, sp_size, args=(model_type, sequences, seed))
    rows = []
    for i, row in enumerate(per_rank[0]):
        merged = dict(row)
        for key in ("max_abs_diff_logprob", "max_abs_diff_entropy", "max_abs_diff_value"):
            merged[key] = max(rank_rows[i][key] for rank_rows in per_rank)
        rows.append(merged)
    logger.info("SP rows: %s", rows)
    return rows
