"""Test tiers: every test is marked by its folder, so ``-m unit`` (``make test-fast``), ``-m dist``, ``-m gpu`` and
``-m verl`` select exactly one folder, and ``-m "not megatron"`` leaves out what needs megatron-core.

- ``unit``: one process on the CPU; ``dist``: 2-4 gloo processes on the CPU; ``gpu``: needs CUDA (skips cleanly
  without it); ``verl``: runs verl's own classes (skips without verl).
- ``megatron``: the test's module needs megatron-core, which it says the one way the suite uses: it imports
  ``megatron`` (anywhere in the file) or calls ``pytest.importorskip("megatron...")``.

``tests/support/`` holds the helpers several test modules share (imported as ``support.<module>``); it is not a
tier and nothing in it is collected.
"""

from __future__ import annotations

import ast
import signal
from functools import lru_cache
from pathlib import Path

import pytest


TESTS_DIR = Path(__file__).resolve().parent
TIERS = ("unit", "dist", "gpu", "verl", "engines")
collect_ignore = ["support"]


def tier_of(path: Path) -> str:
    """The tier of a test file: the folder under ``tests/`` it lives in."""
    parts = Path(path).resolve().relative_to(TESTS_DIR).parts
    if len(parts) < 2 or parts[0] not in TIERS:
        raise pytest.UsageError(f"{path}: test files live in one of tests/{{{','.join(TIERS)}}}/; move it there")
    return parts[0]


def _names_megatron(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "megatron" for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "megatron"
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "importorskip":
        first = node.args[0] if node.args else None
        return isinstance(first, ast.Constant) and str(first.value).split(".")[0] == "megatron"
    return False


@lru_cache(maxsize=None)
def needs_megatron(path: Path) -> bool:
    """Whether the file imports megatron or asks ``pytest.importorskip`` for it."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
    return any(_names_megatron(node) for node in ast.walk(tree))


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item.path)))
        if needs_megatron(Path(item.path)):
            item.add_marker(pytest.mark.megatron)


def pytest_configure(config) -> None:
    """A shell without job control starts background jobs with SIGINT ignored (``nohup make test &``), and what
    actorcore starts then keeps it ignored, as it should. The Ctrl-C tests send SIGINT to this process and to the
    conversions it starts: give it Python's own handler back (the processes started from here then begin with the
    default again)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
