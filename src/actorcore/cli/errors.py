"""How every ``actorcore`` sub-command ends: exit 0 OK, 1 FAIL (a check found a difference), 2 bad input, always
as one line on stderr and never a traceback for something the user can fix (a bug keeps its traceback)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

EXIT_OK, EXIT_FAIL, EXIT_USER_ERROR = 0, 1, 2
USER_ERRORS = (ValueError, OSError, KeyError, ImportError)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = str(exc.args[0])
    return text.splitlines()[0] if text else type(exc).__name__


def is_user_error(exc: BaseException) -> bool:
    """Bad input: actorcore's ``ValueError`` family, a file problem, a missing optional dependency, or a damaged
    safetensors file (safetensors' own error type)."""
    return isinstance(exc, USER_ERRORS) or type(exc).__name__ == "SafetensorError"


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad argument reported on one line (``error: ... (see --help)``) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)


def run_command(command: Callable[[], int]) -> int:
    """``command()``'s exit code; bad input -> its one-line message on stderr and exit 2."""
    try:
        return int(command() or 0)
    except BaseException as exc:  # noqa: BLE001 - sorted: bugs are re-raised with their traceback
        if not is_user_error(exc):
            raise
        print(f"error: {first_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
