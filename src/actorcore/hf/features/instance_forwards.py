"""Objects installed as modules' instance ``forward``, and the undo that restores exactly what was there.

The patches (tiled MLP, recomputed norms, hybrid linear attention) all replace a module's ``forward`` on the
instance only: ``module.__dict__["forward"]`` shadows the class's method and can be popped again. The objects
hold their module (never a closure), so ``copy.deepcopy`` of the model gives copies that run the copy's module.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def wrapped_forward(module: torch.nn.Module, previous: Callable | None) -> Callable:
    """The forward an installed object wraps: the instance forward that was there before it, else the class's."""
    return previous if previous is not None else type(module).forward.__get__(module)


def install_forwards(modules: list[torch.nn.Module], make: Callable[[torch.nn.Module, Any], Any]
                     ) -> tuple[list[Any], Callable[[], None]]:
    """Set each module's instance forward to ``make(module, previous)`` (``previous``: the instance forward that
    was there, else ``None``); returns the forwards and the undo. If ``make`` raises, nothing stays installed."""
    saved, forwards = [], []

    def restore() -> None:
        for module, had, previous in reversed(saved):
            if had:
                module.__dict__["forward"] = previous
            else:
                module.__dict__.pop("forward", None)
        saved.clear()

    try:
        for module in modules:
            had, previous = "forward" in module.__dict__, module.__dict__.get("forward")
            forward = make(module, previous)
            saved.append((module, had, previous))
            module.__dict__["forward"] = forward
            forwards.append(forward)
    except BaseException:
        restore()
        raise
    return forwards, restore
