"""Test support: the receiving side of an export test, a bare module with the sender's state-dict layout."""

from __future__ import annotations

from typing import Iterable

import torch


def module_of(spec: Iterable[tuple[str, tuple[int, ...], torch.dtype]], device: str = "cpu") -> torch.nn.Module:
    """A module with a zero parameter per ``(name, shape, dtype)`` of ``spec``: a receiving model without importing
    transformers in the child process (the receivers only need state-dict names, shapes and dtypes)."""
    root = torch.nn.Module()
    for name, shape, dtype in spec:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device),
                                                           requires_grad=False))
    return root
