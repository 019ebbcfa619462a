"""The per-call ``trace`` Counter of the kernel entry points (keys listed in ``actorcore.kernels``).

A trace is an observation passed in by the caller, so tests and routes can prove which path ran
without module-level counters; ``None`` (the default) records nothing.
"""

from __future__ import annotations

from collections import Counter


def check_trace(trace: object) -> Counter[str] | None:
    """``trace`` itself, if it is None or a ``collections.Counter``; anything else is refused before any work."""
    if trace is not None and not isinstance(trace, Counter):
        raise ValueError(f"trace must be a collections.Counter or None, got {type(trace).__name__}; pass "
                         "trace=collections.Counter()")
    return trace


def add(trace: Counter[str] | None, key: str, count: int = 1) -> None:
    """``trace[key] += count`` when a trace was given; keys are ``"<area>:<name>"``."""
    if trace is not None:
        trace[key] += count
