"""Test support: copies of a (patched) model as RL code makes them, and a fresh twin with the same weight change."""

from __future__ import annotations

import copy
import io
from typing import Callable

import torch


def copy_model(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """``copy.deepcopy`` (``how="deepcopy"``) or a ``torch.save`` / ``torch.load`` round trip (``"torch.save"``)."""
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def scale_weights_of_copy_and_twin(clone: torch.nn.Module, build: Callable[[], torch.nn.Module],
                                   factor: float = 1.25) -> torch.nn.Module:
    """Scale every parameter of ``clone`` and of a freshly built twin of the original; return the twin.

    The copy must then compute what the twin computes: with its own (changed) weights, not the original's.
    """
    twin = build()
    with torch.no_grad():
        for p, q in zip(clone.parameters(), twin.parameters()):
            p.mul_(factor)
            q.mul_(factor)
    return twin
