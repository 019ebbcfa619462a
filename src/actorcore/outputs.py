"""Result types shared by both routes (HF and Megatron-Core), so neither imports the other for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogProbOutput:
    """``log_probs`` and ``entropy`` are float32 ``[T]`` aligned to the scored token (0 at sequence starts).
    ``mtp_log_probs``: the Megatron route's multi-token-prediction depths, ``[mtp, T]`` (None unless asked for)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    mtp_log_probs: torch.Tensor | None = None
