"""``initialize_megatron`` and ``context_from_megatron`` on gloo (2 ranks): the context's tp / pp / ep / dp
axes are Megatron's groups; a caller's Megatron state with the same layout is reused as it is (groups and
seeded RNG tracker untouched), one with another layout is refused, never destroyed."""

from __future__ import annotations

import pytest

from actorcore.testing.distributed import run_distributed

pytest.importorskip("megatron.core")


def _caller_initialised_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore.parallel import McoreParallel, context_from_megatron, initialize_megatron

    with CpuRuntime():
        # The caller sets Megatron up itself, with its own seed.
        ps.initialize_model_parallel(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)
        model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)
        tp_group, tracker = ps.get_tensor_model_parallel_group(), get_cuda_rng_tracker()
        seeds = set(tracker.seeds_)

        context = initialize_megatron(McoreParallel(tp=2), seed=0)
        reused = {
            "sizes": (context.tp_size, context.pp_size, context.ep_size, context.dp_size),
            "tp_rank": context.tp_rank == dist.get_rank(),
            "same_group": context.tp_group is tp_group and ps.get_tensor_model_parallel_group() is tp_group,
            "same_tracker": get_cuda_rng_tracker() is tracker and set(tracker.seeds_) == seeds,
            "same_context": context == context_from_megatron(),
        }
        try:
            initialize_megatron(McoreParallel(pp=2))
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        reused["still_initialised"] = ps.model_parallel_is_initialized() and \
            ps.get_tensor_model_parallel_group() is tp_group
        ps.destroy_model_parallel()
        # Fresh: initialised and seeded here.
        fresh = initialize_megatron(McoreParallel(pp=2), seed=3)
        fresh_sizes = (fresh.tp_size, fresh.pp_size, fresh.ep_size, fresh.dp_size, fresh.pp_rank)
        ps.destroy_model_parallel()
    return {"reused": reused, "refused": refused, "fresh": fresh_sizes}


@pytest.mark.slow
def test_initialize_megatron_reuses_or_refuses_existing_state():
    results = run_distributed(_caller_initialised_worker, 2)
    for rank, result in enumerate(results):
        assert result["reused"] == {"sizes": (2, 1, 1, 1), "tp_rank": True, "same_group": True, "same_tracker": True,
                                    "same_context": True, "still_initialised": True}
        assert "already initialised with another layout" in result["refused"]
        assert "tp=2 (wanted 1)" in result["refused"] and "pp=1 (wanted 2)" in result["refused"]
        assert "destroy_model_parallel()" in result["refused"]
        assert result["fresh"] == (1, 2, 1, 1, rank)


def test_context_without_megatron_state_is_a_clear_error():
    from megatron.core import parallel_state as ps

    from actorcore.mcore.parallel import context_from_megatron

    if ps.model_parallel_is_initialized():
        pytest.skip("this process has Megatron state")
    with pytest.raises(ValueError, match="not initialised: call actorcore.mcore.initialize_megatron"):
        context_from_megatron()
