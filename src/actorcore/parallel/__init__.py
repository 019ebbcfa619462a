"""Parallel state (``ParallelContext``), the one module that issues collectives, and Ulysses ops."""

from actorcore.parallel.context import ParallelContext, sp_size

__all__ = ["ParallelContext", "sp_size"]
