"""A torch norm for Megatron's local layer spec that also runs under sequence parallelism.

megatron-core trains MoE layers under tensor parallelism only with sequence parallelism, and its local
(non-TransformerEngine) norm, ``WrappedTorchNorm``, asserts that sequence parallelism is off. The math of a
norm does not change under sequence parallelism: each TP rank normalises its own slice of the tokens. What
changes is the gradient of the norm's weight, which is then partial on each rank.
``SequenceParallelTorchNorm`` builds the same torch ``RMSNorm`` / ``LayerNorm`` and marks its parameters
``sequence_parallel`` (as TransformerEngine's norms do): the attribute by which Megatron's
``finalize_model_grads`` sums those gradients over the TP group.

Zero-centred RMSNorms (``layernorm_zero_centered_gamma``: the stored weight ``w`` scales by ``1 + w``, as Qwen3-Next
and Qwen3.5 keep it) are ``ZeroCenteredRMSNorm``, which computes exactly what those models' own norm computes
(normalise and scale in fp32, then cast), so the stored weight converts unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_TORCH_NORMS = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm scaling by ``1 + weight`` (weight starts at zero), in fp32, cast back to the input's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class SequenceParallelTorchNorm:
    """``WrappedTorchNorm``'s constructor; returns a torch norm whose parameters carry ``sequence_parallel``."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        # As WrappedTorchNorm: the config's normalization decides, and the fused-kernel options are refused.
        zero_centred = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        if zero_centred and config.normalization != "RMSNorm":
            raise ValueError("layernorm_zero_centered_gamma=True: the local torch norms have it for RMSNorm only")
        for option in ("persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, option, False):
                raise ValueError(f"{option}=True needs a fused norm (TransformerEngine or Apex); the local torch "
                                 "norm does not have it: leave it False")
        if config.normalization not in _TORCH_NORMS:
            raise ValueError(f"normalization={config.normalization!r} is not one of {sorted(_TORCH_NORMS)}")
        if zero_centred:
            norm = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        else:
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
