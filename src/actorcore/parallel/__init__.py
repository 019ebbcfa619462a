"""Parallel state (``ParallelContext``), the one module that issues collectives, and Ulysses ops."""

from actorcore.parallel.context import ParallelContext

__all__ = ["ParallelContext"]
