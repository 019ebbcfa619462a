"""The output directory of a CLI command: written under a temporary name, renamed when complete.

Nothing half-written is ever at ``DST``: on failure or interruption the temporary directory is removed (with
signals held back so that the removal completes); one left by a killed run is swept by the next run. A full
disk is recognised even where torch's writer reports it as something else.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
from typing import Iterator

from actorcore.lifecycle import Interrupted, make_temp_dir, signals_blocked, sweep_stale_temps
from actorcore.mcore.convert import fault_points

_NEARLY_FULL_BYTES = 1 << 20


def disk_full(exc: BaseException) -> bool:
    """Did ``exc`` (or what it wraps: a cause, torch's per-rank checkpoint failures) come from a full disk?"""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "StorageFull" in str(e):
            return True
        todo += [e.__cause__, e.__context__]
        todo += [f for f in (getattr(e, "failures", None) or {}).values() if isinstance(f, BaseException)]
    return False


def nearly_full(directory: str) -> bool:
    """Is the filesystem of ``directory`` (almost) out of space? Checked when a write failed, before the
    temporary output is removed."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize < _NEARLY_FULL_BYTES


def _sweep_stale_temps(dst: str) -> None:
    """Remove temporary directories of ``dst`` left by killed runs (``actorcore.lifecycle``); report the others."""
    removed, others = sweep_stale_temps(dst)
    for path in removed:
        print(f"removed {path}, left by an interrupted conversion (its process no longer runs)", file=sys.stderr)
    for path in others:
        print(f"note: {path} belongs to another conversion (running, or of an older actorcore); remove it "
              "if none is running", file=sys.stderr)


@contextlib.contextmanager
def atomic_output(dst: str) -> Iterator[str]:
    """A temporary directory next to ``dst``, renamed to ``dst`` on success and removed on failure.

    ``actorcore.lifecycle.make_temp_dir``: its mode follows the umask; named ``.DST.tmp-<pid>-<random>`` so that a
    later run can tell whether the run that made it still lives.
    """
    dst = os.path.abspath(dst)
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} already exists; choose a new output directory")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    _sweep_stale_temps(dst)
    tmp = make_temp_dir(dst)
    try:
        yield tmp
        fault_points.reach("renaming")
        os.rename(tmp, dst)
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        interrupted = isinstance(exc, (Interrupted, KeyboardInterrupt))
        if not interrupted and not disk_full(exc) and nearly_full(parent):  # torch's writer hides ENOSPC
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from exc
        raise
    finally:
        with signals_blocked():
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
