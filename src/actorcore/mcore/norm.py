"""A torch norm for Megatron's local layer spec that also runs under sequence parallelism.

megatron-core trains MoE layers under tensor parallelism only with sequence parallelism, and its local
(non-TransformerEngine) norm, ``WrappedTorchNorm``, asserts that sequence parallelism is off. The math of a
norm does not change under sequence parallelism: each TP rank normalises its own slice of the tokens. What
changes is the gradient of the norm's weight, which is then partial on each rank.
``SequenceParallelTorchNorm`` builds the same torch ``RMSNorm`` / ``LayerNorm`` and marks its parameters
``sequence_parallel`` (as TransformerEngine's norms do): the attribute by which Megatron's
``finalize_model_grads`` sums those gradients over the TP group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_TORCH_NORMS = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}


class SequenceParallelTorchNorm:
    """``WrappedTorchNorm``'s constructor; returns a torch norm whose parameters carry ``sequence_parallel``."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        # As WrappedTorchNorm: the config's normalization decides, and the fused-kernel options are refused.
        for option in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, option, False):
                raise ValueError(f"{option}=True needs a fused norm (TransformerEngine or Apex); the local torch "
                                 "norm does not have it: leave it False")
        if config.normalization not in _TORCH_NORMS:
            raise ValueError(f"normalization={config.normalization!r} is not one of {sorted(_TORCH_NORMS)}")
        norm = _TORCH_NORMS[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_sequence_parallel_norms(spec: Any) -> Any:
    """``spec`` (a ModuleSpec / submodules tree) with every ``WrappedTorchNorm`` replaced; other nodes kept."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def walk(node: Any) -> Any:
        if node is WrappedTorchNorm:
            return SequenceParallelTorchNorm
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, tuple):
            return tuple(walk(item) for item in node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changed = {}
            for field in dataclasses.fields(node):
                if field.init:
                    old = getattr(node, field.name)
                    new = walk(old)
                    if new is not old:
                        changed[field.name] = new
            return dataclasses.replace(node, **changed) if changed else node
        return node

    return walk(spec)
