"""verl's rollout batch layout, shared by the verl tests: left-padded prompts, right-padded responses, position ids
from the attention mask, and optionally the per-token PPO inputs (off-policy old log-probs, advantages,
reference log-probs)."""

from __future__ import annotations

import torch


def padded_rollout(prompts: tuple[int, ...], responses: tuple[int, ...], seed: int, ppo: bool = False) -> dict:
    """Random tokens (3..130) of the given prompt and response lengths in verl's padded layout."""
    g = torch.Generator().manual_seed(seed)
    P, R = max(prompts), max(responses)
    input_ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, P - p:P + r] = torch.randint(3, 131, (p + r,), generator=g)
        mask[i, P - p:P + r] = 1
    batch = {"input_ids": input_ids, "attention_mask": mask, "position_ids": (torch.cumsum(mask, 1) - 1).clamp(min=0),
             "prompts": input_ids[:, :P].clone(), "responses": input_ids[:, P:].clone()}
    if ppo:
        response_mask = mask[:, P:].clone()
        noise = lambda: torch.randn(len(prompts), R, generator=g) * response_mask  # noqa: E731
        batch.update(response_mask=response_mask, old_log_probs=-5.0 + 0.3 * noise(),
                     ref_log_prob=-5.0 + 0.3 * noise(), advantages=noise())
    return batch
