"""Module paths of the Megatron route kept for one release after ``mcore/`` was split by job into ``build/``,
``run/`` and ``convert/``: importing an old path warns (``DeprecationWarning``, pointed at the importing line) and
gives the module at its new path, the same module object, private names included."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make ``old`` (the module being imported) the module ``new``, with a DeprecationWarning."""
    # stacklevel 3: past this function and the old module; warnings skips importlib's own frames
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes away in the next release)",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
