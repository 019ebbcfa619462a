"""Several Megatron test cases in one spawn: the distributed tests run every case of one world size in the same
gloo processes (interpreter and import start-up dominate a tiny case), each case under a fresh Megatron parallel
state, and return per-case results that the pytest tests then assert one by one.

A case is ``(name, fn, args)`` with ``fn`` importable (module level): it runs as ``fn(*args)`` on every rank inside
megatron-core's CPU runtime, initialises Megatron itself (``initialize_megatron``) and returns what the test
checks. A case that raises stops the run (the other ranks may be waiting in a collective of that case); the
error names the case.
"""

from __future__ import annotations

from typing import Any, Callable

from actorcore.parallel.spawn import run_distributed

Case = tuple[str, Callable[..., Any], tuple]


def _run_cases(rank: int, world_size: int, cases: list[Case]) -> dict[str, Any]:
    from megatron.core import parallel_state

    from actorcore.mcore.cpu_runtime import CpuRuntime

    results = {}
    with CpuRuntime():
        for name, fn, args in cases:
            try:
                results[name] = fn(*args)
            except BaseException as exc:
                raise RuntimeError(f"Megatron test case {name!r} failed on rank {rank}") from exc
            finally:
                if parallel_state.model_parallel_is_initialized():
                    parallel_state.destroy_model_parallel()
    return results


def spawn_cases(world_size: int, cases: list[Case]) -> dict[str, list[Any]]:
    """Run every case in one spawn of ``world_size`` processes; ``{name: [result of rank 0, rank 1, ...]}``."""
    names = [name for name, _, _ in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be unique, got {names}")
    per_rank = run_distributed(_run_cases, world_size, args=(cases,))
    return {name: [result[name] for result in per_rank] for name in names}


def stapled_attributes(model: Any) -> list[str]:
    """Attributes of actorcore's set on the model's Megatron modules (``module.path: name``): the handle holds
    every fact of ours, so this is empty."""
    return [f"{path}: {name}" for chunk in model.chunks for path, module in chunk.named_modules()
            for name in vars(module) if "actorcore" in name.lower()]
