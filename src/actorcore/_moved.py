"""Names kept for one release after a move or a rename: importing an old module path, or using an old name, warns
(``DeprecationWarning``, pointed at the caller's line) and gives the new one. The Megatron route's modules before
``mcore/`` was split by job into ``build/``, ``run/`` and ``convert/``; the options and modules renamed because their
names misled (``fused_decoder`` -> ``compiled_decoder``, ``dense_mlp`` -> ``swiglu_mlp``, ...)."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make ``old`` (the module being imported) the module ``new`` (the same object, private names included), with
    a DeprecationWarning."""
    # stacklevel 3: past this function and the old module; warnings skips importlib's own frames
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes away in the next release)",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)


def renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` (an option, a value, a keyword, a name) is now ``new``."""
    warnings.warn(f"{old} was renamed {new}; use the new name (the old one goes away in the next release)",
                  DeprecationWarning, stacklevel=stacklevel)
