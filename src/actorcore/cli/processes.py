"""Signals and rank processes of a CLI command, so that no interruption leaves a process or a file behind.

- ``SignalGuard``, ``signals_blocked``, ``pid_alive`` (from ``actorcore.lifecycle``, shared with the library's
  writers): SIGINT / SIGTERM raise ``Interrupted`` while a command runs; cleanup is not cut short by a second
  signal.
- ``run_ranks``: one spawned process per rank, each killed by the kernel if the parent dies (Linux
  ``PR_SET_PDEATHSIG``, a polling thread elsewhere) and ignoring SIGINT (a terminal's Ctrl-C reaches the
  whole process group; the parent decides). The parent polls their liveness, never waits for ever, and stops
  every rank (SIGTERM, then SIGKILL) when one fails or when the parent itself is interrupted.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from actorcore.lifecycle import signals_blocked

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Make this process end when ``parent_pid`` does (it may already have)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


def _rank_main(target: Callable, rank: int, world_size: int, parent_pid: int, args: tuple) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    target(rank, world_size, *args)


def stop_processes(processes: list[Any], grace_s: float) -> None:
    """SIGTERM every started process still running, SIGKILL what is left after ``grace_s``; reap them all."""
    started = [p for p in processes if p.pid is not None]
    for p in started:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in started:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in started:
        if p.exitcode is None:
            p.kill()
            p.join(5.0)


def run_ranks(target: Callable, world_size: int, args: tuple, *, grace_s: float = 5.0,
              poll_s: float = 0.5) -> list[int]:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` spawned processes; their exit codes.

    Returns when all have exited or one has failed (the others are then stopped); stops them all if the
    parent is interrupted. ``target`` must be importable (module level).
    """
    context = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    try:
        for rank in range(world_size):
            process = context.Process(target=_rank_main, args=(target, rank, world_size, os.getpid(), args),
                                      daemon=True, name=f"actorcore-rank{rank}")
            processes.append(process)
            process.start()
        while True:
            running = [p for p in processes if p.exitcode is None]
            if not running or any(p.exitcode for p in processes):
                break
            multiprocessing.connection.wait([p.sentinel for p in running], timeout=poll_s)
    finally:
        with signals_blocked():
            stop_processes(processes, grace_s)
    return [p.exitcode for p in processes]
