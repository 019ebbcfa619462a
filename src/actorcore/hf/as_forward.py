"""Running code as a module's forward, so the hooks on the module (FSDP2's unshard and reduce) run around it."""

from __future__ import annotations

from typing import Any, Callable

import torch


def call_as_forward(module: torch.nn.Module, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` as ``module``'s forward, so hooks on the module run around it.

    FSDP2 unshards a module's parameters in its forward pre-hook and arranges their gradient reduction in its
    post-hook; calling sub-modules or reading ``module.weight`` outside ``module(...)`` would see shards.
    The instance's ``forward`` is replaced for this one call and restored.
    """
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")
    module.forward = _run_thunk
    try:
        # Passed as a keyword, not as no arguments: torch 2.11's FSDP2 root pre-forward indexes args[0].
        return module(actorcore_thunk=fn)
    finally:
        if had_own:
            module.forward = own
        else:
            del module.forward


def _run_thunk(actorcore_thunk: Callable[[], Any]) -> Any:
    return actorcore_thunk()
