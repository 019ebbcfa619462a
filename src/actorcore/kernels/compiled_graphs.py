"""What the regions actorcore compiles with ``torch.compile`` share: room for their graph variants, and compiled
graphs that say when they run.

Why: past ``torch._dynamo.config.recompile_limit`` (8 graphs per code object by default) Dynamo runs a frame's Python
uncompiled, with only a log line. A region compiled for speed would then run slower, and differently rounded, in
silence. Each compiled region runs inside ``variant_room`` (room for the variants its callers legitimately create) and
compiles through a backend whose graphs report each run (``ReportingGraph``), so its caller can tell a call in which
no compiled graph ran and refuse it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

# Graphs one compiled region may hold: its variants multiply (gradients on or off, training or eval, optional
# outputs kept or made again, each attention backend, every model of a class in the process). Past this the region's
# caller refuses the call rather than run it uncompiled.
VARIANTS_LIMIT = 64


def variant_room() -> contextlib.AbstractContextManager:
    """Dynamo's recompile limit raised to ``VARIANTS_LIMIT`` while a compiled region runs (never below the process's
    own setting), and set back after."""
    return _VariantRoom()


class _VariantRoom:
    """``variant_room``'s context manager: one read and at most two writes of Dynamo's setting per call (a region
    runs several times per layer; ``config.patch`` costs tens of microseconds each time)."""

    __slots__ = ("saved",)

    def __enter__(self) -> None:
        dynamo = torch._dynamo.config
        self.saved = dynamo.recompile_limit
        if self.saved < VARIANTS_LIMIT:
            dynamo.recompile_limit = VARIANTS_LIMIT

    def __exit__(self, *exc: object) -> None:
        if self.saved < VARIANTS_LIMIT:
            torch._dynamo.config.recompile_limit = self.saved


class ReportingGraph:
    """A compiled graph that calls ``on_run`` before each run (its caller counts the graphs that ran)."""

    def __init__(self, compiled: Callable, on_run: Callable[[], None]) -> None:
        self.compiled = compiled
        self.on_run = on_run
        self._boxed_call = getattr(compiled, "_boxed_call", False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.on_run()
        return self.compiled(*args, **kwargs)


class GraphRunCounter:
    """An Inductor backend for ``torch.compile`` whose graphs count their runs in ``runs``."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        return ReportingGraph(compile_fx(gm, example_inputs), self._ran)

    def _ran(self) -> None:
        self.runs += 1
