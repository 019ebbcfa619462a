"""Run a function on N local gloo processes (CPU) and collect what each rank returns.

``run_distributed(fn, world_size=2, args=(...))`` calls ``fn(rank, world_size, *args)`` in fresh processes
with the default process group initialised. Used by the demo's sequence-parallel rows and by the distributed
tests (``actorcore.testing.distributed`` re-exports it).

The processes are forked from multiprocessing's fork server, which has imported torch and transformers' model
code once: a spawned interpreter spends seconds of CPU on those imports (measured: 3.7 s for torch, 10 s with
``transformers.modeling_utils``), a fork milliseconds. The server itself never runs torch work, so each child
starts as a fresh process would (no threads, no CUDA context); it receives the caller's current environment.
Where CUDA is available the processes are spawned instead (``start_method``).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server (a module that is not installed is skipped by multiprocessing).
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "transformers.modeling_utils")


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, env: dict) -> None:
    os.environ.clear()  # the fork server's environment is the one of its start: take the caller's
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        # A file rendezvous in the run's own directory: no port to race for with other runs.
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}", rank=rank,
                                world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_method() -> str:
    """``"forkserver"`` on a machine without CUDA; ``"spawn"`` where CUDA is available: there the fork server's
    imports initialised CUDA (on the H100, 2026-12-07, its children's ``torch.cuda.set_device`` failed with "Cannot
    re-initialize CUDA in forked subprocess"), and a forked child cannot use CUDA after that."""
    return "spawn" if torch.cuda.is_available() else "forkserver"


def run_distributed(fn: Callable, world_size: int, args: tuple = (), env: dict[str, str] | None = None) -> list[Any]:
    """Spawn ``world_size`` gloo processes running ``fn(rank, world_size, *args)``; return results by rank.

    ``fn`` must be importable (module level). Results travel through ``torch.save``; a failure on any rank
    raises ``RuntimeError`` with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        method = start_method()
        if method == "forkserver":
            multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
        ctx = mp.start_processes(_worker, args=(world_size, port, out_dir, fn, args, {**os.environ, **(env or {})}),
                                 nprocs=world_size, join=False, start_method=method)
        errors = []
        try:
            while not ctx.join():  # join() returns once any one process ends: wait for all of them
                pass
        except Exception as exc:  # noqa: BLE001 - collect per-rank tracebacks below
            errors.append(str(exc))
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank} wrote no result")
                continue
            payload = torch.load(path, weights_only=False)
            if not payload["ok"]:
                errors.append(f"rank {rank}:\n{payload['error']}")
            results.append(payload.get("result"))
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
