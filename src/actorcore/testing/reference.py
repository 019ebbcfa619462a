"""Plain Hugging Face references the packed path is checked against (tests and the demo)."""

from __future__ import annotations

from typing import Any

import torch


def padded_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, as generation does for left-padded rows."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def padded_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """An unpatched HF forward on a padded ``[B, S]`` batch; logits as the model returns them."""
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=padded_position_ids(attention_mask), use_cache=False, **kwargs)
    return out.logits


def logprobs_from_logits(logits_BSV: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits / T)`` at the next token and the entropy, aligned to the scored token.

    Returns ``[B, S]`` tensors in the padded layout; 0 at each row's first real token and at padding.
    """
    logp = torch.log_softmax(logits_BSV.float() / temperature, dim=-1)
    scored = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(scored)
    scored[:, 1:] = logp[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    entropy[:, 1:] = -(logp[:, :-1].exp() * logp[:, :-1]).sum(-1)
    mask = attention_mask.bool()
    valid = mask.clone()
    valid[:, 1:] &= mask[:, :-1]  # the predicting token must be real too
    valid[:, 0] = False
    return torch.where(valid, scored, 0.0), torch.where(valid, entropy, 0.0)


def padded_to_packed(values_BS: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Real tokens of a padded ``[B, S]`` tensor, in packed order ``[T]``."""
    return values_BS[attention_mask.bool()]


def reference_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed-order ``[T]`` log-probs and entropy from the unpatched padded HF forward."""
    logits = padded_logits(model, input_ids, attention_mask)
    lp, ent = logprobs_from_logits(logits, input_ids, attention_mask, temperature)
    return padded_to_packed(lp, attention_mask), padded_to_packed(ent, attention_mask)


def right_padded(sequences: list[torch.Tensor], pad_id: int = 0, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S], attention_mask [B, S])`` padded on the right (or the left)."""
    longest = max(int(s.numel()) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, s in enumerate(sequences):
        n = int(s.numel())
        sl = slice(longest - n, longest) if left else slice(0, n)
        ids[i, sl] = s
        mask[i, sl] = 1
    return ids, mask
