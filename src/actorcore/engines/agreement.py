"""Trainer-engine agreement of a rollout: actorcore's log-probs of the tokens an engine sampled, beside the engine's
own, with the statistics RL users monitor and the truncated importance weights that correct for the difference.

Comparable numbers need the same distribution on both sides: the engine's log-probs of the *processed*
distribution (vLLM: ``logprobs_mode="processed_logprobs"``, which applies the temperature; the default
``raw_logprobs`` is the temperature-1 distribution whatever the sampling temperature) and actorcore's
``temperature`` equal to the sampling temperature; no top-k / top-p / penalties in the sampling (they change the
engine's processed distribution, which actorcore does not reproduce).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from actorcore.hf.packing import pack


@dataclass
class Agreement:
    """Per rollout: ``log_probs`` (actorcore's, float32, one tensor of completion tokens per rollout), the engine's
    ``engine_log_probs`` and ``importance_weights`` ``min(exp(trainer - engine), clip)`` (truncated importance
    sampling); over all completion tokens: ``max_abs`` / ``mean_abs`` of ``trainer - engine``, ``k3_kl``: the k3
    estimate of KL(engine || trainer) from the engine's samples (mean of ``exp(r) - 1 - r``, ``r = trainer -
    engine``), ``fraction_beyond``: the share of tokens with ``|trainer - engine| > threshold``."""

    log_probs: list[torch.Tensor]
    engine_log_probs: list[torch.Tensor]
    importance_weights: list[torch.Tensor]
    max_abs: float
    mean_abs: float
    k3_kl: float
    fraction_beyond: float
    threshold: float
    clip: float
    tokens: int

    def summary(self) -> dict[str, float]:
        return {"max_abs": self.max_abs, "mean_abs": self.mean_abs, "k3_kl": self.k3_kl,
                "fraction_beyond": self.fraction_beyond, "tokens": float(self.tokens)}


def agreement_stats(trainer: torch.Tensor, engine: torch.Tensor, threshold: float, clip: float
                    ) -> tuple[float, float, float, float, torch.Tensor]:
    """``(max_abs, mean_abs, k3_kl, fraction_beyond, importance_weights)`` of two float32 ``[N]`` log-prob vectors."""
    if trainer.shape != engine.shape:
        raise ValueError(f"trainer and engine log-probs differ in shape: {tuple(trainer.shape)} vs "
                         f"{tuple(engine.shape)}")
    ratio_log = trainer.double() - engine.double()
    weights = ratio_log.exp().clamp(max=clip).float()
    if ratio_log.numel() == 0:
        return 0.0, 0.0, 0.0, 0.0, weights
    diff = ratio_log.abs()
    k3 = (ratio_log.exp() - 1 - ratio_log).mean()
    return (float(diff.max()), float(diff.mean()), float(k3), float((diff > threshold).double().mean()), weights)


def rollout_agreement(model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                      engine_log_probs: Sequence[Sequence[float]], *, temperature: float = 1.0,
                      threshold: float = 0.1, clip: float = 2.0, parallel: Any = None) -> Agreement:
    """actorcore's log-probs (no gradient) of every rollout's completion tokens under ``model`` at ``temperature``,
    compared per token with the engine's (``engine_log_probs[i][j]`` for ``completions[i][j]``).

    ``threshold`` (nats) sets ``fraction_beyond``; ``clip`` truncates the importance weights (``clip >= 1``).
    ``parallel``: as for ``compute_logprobs`` (every SP rank passes the same rollouts).
    """
    from actorcore.hf.logprobs import compute_logprobs

    if not (len(prompts) == len(completions) == len(engine_log_probs)) or not prompts:
        raise ValueError(f"prompts, completions and engine_log_probs must be equally long and non-empty, got "
                         f"{len(prompts)}, {len(completions)}, {len(engine_log_probs)}")
    if not threshold >= 0 or not clip >= 1:
        raise ValueError(f"threshold must be >= 0 and clip >= 1, got {threshold} and {clip}")
    sequences, engine = [], []
    for i, (prompt, completion, lp) in enumerate(zip(prompts, completions, engine_log_probs)):
        if len(completion) != len(lp):
            raise ValueError(f"rollout {i}: {len(completion)} completion tokens but {len(lp)} engine log-probs")
        if not len(prompt):
            raise ValueError(f"rollout {i} has an empty prompt: the first completion token needs one before it")
        sequences.append(torch.tensor(list(prompt) + list(completion), dtype=torch.long))
        engine.append(torch.as_tensor(lp, dtype=torch.float32).reshape(-1))
    device = next(model.parameters()).device
    batch = pack(sequences)
    with torch.no_grad():
        out = compute_logprobs(model, batch.to(device), temperature=temperature, entropy=False, parallel=parallel)
    flat = out.log_probs.float().cpu()
    trainer = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        start = int(batch.cu_seqlens[i]) + len(prompt)
        trainer.append(flat[start:start + len(completion)])
    max_abs, mean_abs, k3, beyond, weights = agreement_stats(torch.cat(trainer), torch.cat(engine), threshold, clip)
    sizes = [len(c) for c in completions]
    return Agreement(log_probs=trainer, engine_log_probs=engine, importance_weights=list(weights.split(sizes)),
                     max_abs=max_abs, mean_abs=mean_abs, k3_kl=k3, fraction_beyond=beyond, threshold=threshold,
                     clip=clip, tokens=sum(sizes))
