"""Plain Hugging Face references for VLMs: the unpatched padded forward with the processor-style batch, so
the model does its own feature merging, M-RoPE position ids and masking."""

from __future__ import annotations

from typing import Any

import torch

from actorcore.hf.reference import logprobs_from_logits
from actorcore.testing.tiny_vlm import SyntheticSample, padded_processor_batch


def reference_groups(model: Any, samples: list[SyntheticSample]) -> list[list[SyntheticSample]]:
    """Samples split into batches the HF forward can take.

    GLM-4V's HF forward cannot take images and videos in one batch (its video frames use the image token and
    its placeholder mask counts them as images), so its video samples form a second batch.
    """
    from actorcore.archs import spec_for_model

    vision = spec_for_model(model).vision
    if vision.video_token_field != vision.image_token_field:
        return [samples]
    with_video = [s for s in samples if "pixel_values_videos" in s.multimodal]
    without = [s for s in samples if all(s is not v for v in with_video)]
    return [g for g in (without, with_video) if g]


def reference_logprobs_vlm(model: Any, samples: list[SyntheticSample],
                           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed-order ``[T]`` log-probs and entropy from unpatched right-padded HF forwards."""
    per_sample: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for group in reference_groups(model, samples):
        inputs = {k: v.to(model.device) for k, v in padded_processor_batch(group).items()}
        logits = model(**inputs, use_cache=False).logits
        lp, ent = logprobs_from_logits(logits, inputs["input_ids"], inputs["attention_mask"], temperature)
        for row, s in enumerate(group):
            n = s.input_ids.numel()
            per_sample[id(s)] = (lp[row, :n], ent[row, :n])
    return (torch.cat([per_sample[id(s)][0] for s in samples]), torch.cat([per_sample[id(s)][1] for s in samples]))
