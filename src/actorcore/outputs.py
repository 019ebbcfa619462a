"""Result types of the public calls, shared by both routes (HF and Megatron-Core) and the head kernels, so none
imports another for them. Plain dataclasses over torch tensors: the kernels may import this module."""

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


@dataclass
class LossOutput:
    """``loss``: the summed loss (differentiable w.r.t. hidden and weight); ``logprob`` / ``entropy``:
    the per-token values it was computed from, detached (entropy is None when not requested)."""

    loss: torch.Tensor
    logprob: torch.Tensor
    entropy: torch.Tensor | None
