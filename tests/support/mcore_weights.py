"""Randomising the tensors a fresh model initialises to constants, so a checkpoint round trip is a real test."""

from __future__ import annotations

import torch


def randomize_constant_tensors(model, seed: int = 0) -> None:
    """Norm weights (ones), biases and DeepSeek's expert bias (zeros) get distinct random values, so a
    mapping that swapped two of them could not pass."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point() and tensor.numel() > 1 and bool((tensor == tensor.flatten()[0]).all()):
                noise = torch.randn(tensor.shape, generator=gen) * 0.1
                tensor.copy_((tensor.float() + noise).to(tensor.dtype))
