"""Signals, process liveness and temporary directories: what every writer needs so that no interruption leaves a
half-written file, a shared-memory buffer or a waiting peer behind. Used by the library's writers and the CLI.

- ``SignalGuard``: while it is entered, SIGINT and SIGTERM raise ``Interrupted`` in the main thread (Python's
  default SIGTERM kills the process without running any ``finally``); the previous handlers come back after.
- ``signals_forwarded``: the same for a library call (a writer inside the caller's program): the caller's
  handlers are replaced only for the duration of the call; a signal that arrived runs the cleanup, then is
  handed to the caller's handler (or its default action: SIGTERM still ends the process, after the cleanup).
- ``signals_blocked``: a cleanup that a second signal cannot cut short (the signal is delivered after it).
- ``pid_alive`` / ``process_identity``: is a process still running (a zombie is not), and is it still the same
  one (its start time), for sweeping stale temporaries and for noticing a dead peer.
- ``make_temp_dir`` / ``sweep_stale_temps``: ``.DST.tmp-<pid>-<random>`` next to ``DST`` (made with ``os.mkdir``,
  so the umask applies), and the removal of those whose pid no longer runs (a run killed by SIGKILL).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import threading
from typing import Any, Iterator

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived (a BaseException, like KeyboardInterrupt, so that ``except Exception`` in
    library code does not swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class SignalGuard:
    """Context manager: SIGINT / SIGTERM raise ``Interrupted``; ``signum`` records the first one (libraries
    that wrap exceptions, like torch's checkpoint code, may hide the ``Interrupted`` itself). Signals the
    process ignores (``SIG_IGN``, e.g. under ``nohup``) stay ignored. Outside the main thread it does nothing
    (Python delivers signals only there)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        raise Interrupted(signum)

    def __enter__(self) -> "SignalGuard":
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self.previous = {}


def _forward(signum: int, handler: Any) -> None:
    """Hand ``signum`` to the handler that was installed before ours (restored already)."""
    if callable(handler):
        handler(signum, None)  # e.g. Python's default_int_handler raises KeyboardInterrupt
    elif handler in (signal.SIG_DFL, None):
        os.kill(os.getpid(), signum)  # the default action (SIGTERM: the process ends, after our cleanup)


@contextlib.contextmanager
def signals_forwarded() -> Iterator[SignalGuard]:
    """For a library writer: inside the block SIGINT / SIGTERM raise ``Interrupted`` so that its ``finally``
    cleanup runs; on the way out the caller's handlers are back and the signal is forwarded to them (a caller's
    handler that returns leaves the ``Interrupted`` raised: the write did not complete)."""
    guard = SignalGuard()
    with contextlib.ExitStack() as stack:
        stack.enter_context(guard)
        try:
            yield guard
        except Interrupted:
            previous = dict(guard.previous)
            stack.close()  # our handlers out, the caller's back
            if guard.signum is not None:
                _forward(guard.signum, previous.get(guard.signum))
            raise


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """SIGINT / SIGTERM held back (delivered after the block) so that cleanup runs to its end."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _proc_stat(pid: int) -> list[str] | None:
    """The fields after the command name of ``/proc/<pid>/stat`` (state first), None where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_identity(pid: int) -> str | None:
    """What tells this process from a later one that reuses its pid: its start time (Linux ``/proc``), or None
    where that is not known."""
    fields = _proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def pid_alive(pid: int, identity: str | None = None) -> bool:
    """Does ``pid`` still run (not a zombie)? With ``identity`` (from ``process_identity``): and is it still
    that process?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _proc_stat(pid)
    if fields is None:
        return not os.path.isdir("/proc/self")  # no /proc here: os.kill's answer is all there is
    if fields[0] in ("Z", "X"):
        return False
    return identity is None or process_identity(pid) in (None, identity)


def temp_prefix(dst: str) -> str:
    return f".{os.path.basename(dst)}.tmp-"


def make_temp_dir(dst: str) -> str:
    """A new empty directory ``.DST.tmp-<pid>-<random>`` next to ``dst``: ``os.mkdir``, so its mode follows the
    umask like any directory the user creates; the pid tells a later run whether its maker still runs."""
    parent = os.path.dirname(os.path.abspath(dst))
    while True:
        tmp = os.path.join(parent, f"{temp_prefix(dst)}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def sweep_stale_temps(dst: str) -> tuple[list[str], list[str]]:
    """Remove the temporary directories of ``dst`` whose pid no longer runs (left by a killed run); returns
    ``(removed, others)``: ``others`` are the ones of a running process or without a pid, left alone."""
    dst = os.path.abspath(dst)
    parent, prefix = os.path.dirname(dst), temp_prefix(dst)
    removed, others = [], []
    for name in sorted(os.listdir(parent)):
        if not name.startswith(prefix):
            continue
        path = os.path.join(parent, name)
        pid = name[len(prefix):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s, left by an interrupted write (pid %s no longer runs)", path, pid)
            removed.append(path)
        else:
            others.append(path)
    return removed, others


def new_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file here: ``0o666`` less the umask (read from ``/proc`` where it
    can be, so that no other thread sees a changed umask)."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask
