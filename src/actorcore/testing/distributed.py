"""The multi-process (gloo) runner of the distributed tests: the product's ``actorcore.parallel.spawn``."""

from actorcore.parallel.spawn import run_distributed

__all__ = ["run_distributed"]
