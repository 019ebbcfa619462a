"""Plain Hugging Face reference for VLMs: the model's own unpatched forward, one sample at a time, on that
sample's own processor-style inputs (``input_ids [1, L]``, its pixel rows and grids, ``mm_token_type_ids
[1, L]``), so the model does its own feature merging, M-RoPE positions and masking.

It shares no code with the product's packing: nothing is padded, concatenated or split again, no spec is looked
up, and the log-probs are a plain ``log_softmax`` here. A sample whose placeholders disagree with its grids is
refused by the model's own forward, so a wrong input builder cannot pass either.
"""

from __future__ import annotations

from typing import Any

import torch

from actorcore.testing.tiny_vlm import SyntheticSample


def sample_inputs(sample: SyntheticSample) -> dict[str, torch.Tensor]:
    """What a processor returns for a batch of this one sample: per-token inputs get a batch axis of 1."""
    per_token = {"mm_token_type_ids"}
    inputs = {k: (v[None] if k in per_token else v) for k, v in sample.multimodal.items()}
    return {"input_ids": sample.input_ids[None], **inputs}


def _next_token_logprobs(logits_LV: torch.Tensor, ids_L: torch.Tensor, temperature: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L]`` log-prob of each token under the previous position's distribution and that distribution's entropy;
    0 at the first token."""
    logp = torch.log_softmax(logits_LV[:-1].float() / temperature, dim=-1)
    zero = logp.new_zeros(1)
    scored = logp.gather(-1, ids_L[1:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.cat([zero, scored]), torch.cat([zero, entropy])


def reference_logprobs_vlm(model: Any, samples: list[SyntheticSample],
                           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed-order ``[T]`` log-probs and entropies: each sample through the model's own forward, alone."""
    log_probs, entropies = [], []
    for sample in samples:
        inputs = {k: v.to(model.device) for k, v in sample_inputs(sample).items()}
        logits = model(**inputs, use_cache=False).logits[0]
        lp, ent = _next_token_logprobs(logits, inputs["input_ids"][0], temperature)
        log_probs.append(lp)
        entropies.append(ent)
    return torch.cat(log_probs), torch.cat(entropies)
