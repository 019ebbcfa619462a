"""Vision-language models on the Megatron route: a tiny VLM and its image and video samples."""

from __future__ import annotations

import torch


def tiny_vlm(model_type: str = "qwen2_5_vl"):
    from support.mcore_weights import randomize_constant_tensors

    from actorcore.testing.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(model_type, seed=4)
    randomize_constant_tensors(model, seed=2)
    # Sharper attention and logits than the 0.02-std init: positions (M-RoPE) and image features then move the
    # log-probs far beyond the tolerance, so a wrong rotary section or a dropped feature cannot pass.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "lm_head.weight")):
                param.mul_(6.0)
    return model


def vlm_samples(model):
    from actorcore.testing.tiny_vlm import mixed_samples

    return mixed_samples(model, seed=3)  # one image, text only, two images, a video, short text only
