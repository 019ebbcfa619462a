"""Named points of a conversion where a test can pause the process or make it fail.

Signal and disk-full handling can only be tested deterministically if the test knows where the process is.
``reach("saving")`` does nothing unless the environment asks for it:

- ``ACTORCORE_TEST_PAUSE_AT=<point>``: sleep there (for up to an hour) so the test can send a signal; the
  pid is appended to ``ACTORCORE_TEST_PAUSED_FILE`` (when set) once the process is waiting.
- ``ACTORCORE_TEST_FAIL_AT=<point>:ENOSPC``: raise ``OSError(ENOSPC)`` there, as a full disk would.

The variables are read on every call (no state is kept); unset, ``reach`` returns at once.
"""

from __future__ import annotations

import errno
import logging
import os
import time

logger = logging.getLogger(__name__)

POINTS = ("loading", "saving", "renaming", "exporting")
_FAILURES = {"ENOSPC": errno.ENOSPC}


def reach(point: str) -> None:
    """Pause or fail at ``point`` if a test asked for it (see the module docstring)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    fail = os.environ.get("ACTORCORE_TEST_FAIL_AT", "")
    if fail.partition(":")[0] == point:
        code = _FAILURES.get(fail.partition(":")[2])
        if code is None:
            raise ValueError(f"ACTORCORE_TEST_FAIL_AT={fail}: the failure must be one of {', '.join(_FAILURES)}")
        raise OSError(code, os.strerror(code) + f" (injected at {point})")
    if os.environ.get("ACTORCORE_TEST_PAUSE_AT") == point:
        logger.warning("pausing at %s (pid %d) for a test", point, os.getpid())
        marker = os.environ.get("ACTORCORE_TEST_PAUSED_FILE")
        if marker:
            with open(marker, "a") as f:
                f.write(f"{point} {os.getpid()}\n")
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            time.sleep(0.1)  # short sleeps: a signal handler's exception surfaces at once
