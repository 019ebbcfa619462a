"""Tiny seeded vision-language models and synthetic processor-like inputs (no downloads, no processors).

Text part: hidden 64, 4 heads, 2 kv heads, head dim 16, vocab 131, 2 layers (MoE: 4 experts, top-2). Vision
part: 2 blocks of width 32, patch 4, merge 2, so a ``[1, 4, 4]`` image grid is 4 image tokens. The building
blocks, the Qwen2.5-VL config (the demo's VLM) and ``synthetic_sample`` are the product's
``actorcore.hf.embedded``; this module adds a config for every other registered VLM and the test mixes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from actorcore.hf.embedded import (  # noqa: F401 - re-exported for the tests
    GLM_MARKERS,
    IMAGE_END,
    IMAGE_START,
    IMAGE_TOKEN,
    MROPE,
    TEXT_VOCAB,
    TIMESTAMP_TOKEN,
    VIDEO_END,
    VIDEO_START,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    VLM,
    SyntheticSample,
    synthetic_sample,
)
from actorcore.hf.embedded import QWEN_VLM_IDS as QWEN_IDS
from actorcore.testing.tiny_configs import TINY_CONFIGS
from actorcore.hf.embedded import VLM_TEXT as TEXT
from actorcore.hf.embedded import VLM_VISION as VISION
from actorcore.testing.tiny_configs import HYBRID

MOE_TEXT: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, decoder_sparse_step=1,
                                mlp_only_layers=[])
# Kimi-K2.5's text model is DeepSeek-V3 (the text tiny config's MLA and MoE shapes), with yarn rope scaling whose
# mscale and mscale_all_dim differ: the attention scale is not 1/sqrt(qk head dim) and the rotary cos/sin are scaled.
KIMI_YARN: dict[str, Any] = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=64,
                                 mscale=1.0, mscale_all_dim=0.7, beta_fast=16.0, beta_slow=2.0)
GLM_IDS: dict[str, Any] = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, image_start_token_id=IMAGE_START,
                               image_end_token_id=IMAGE_END, video_start_token_id=VIDEO_START,
                               video_end_token_id=VIDEO_END)

# One entry per registered VLM model_type: kwargs for ``AutoConfig.for_model``.
TINY_VLM_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": dict(
        **QWEN_IDS,
        text_config=dict(TEXT, rope_parameters=MROPE),
        vision_config=dict(VISION, embed_dim=32, mlp_ratio=2, hidden_size=64),
    ),
    "qwen2_5_vl": VLM,  # the embedded demo VLM
    # 4 text layers: the deepstack features go into layers 0 and 1 only, and at PP=2 both sit on the first stage
    "qwen3_vl": dict(
        **QWEN_IDS,
        text_config=dict(TEXT, num_hidden_layers=4, rope_parameters=dict(MROPE, mrope_interleaved=True)),
        vision_config=dict(VISION, intermediate_size=40, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
    ),
    "qwen3_vl_moe": dict(
        **QWEN_IDS,
        # layer 1 dense (mlp_only_layers)
        text_config=dict(TEXT, **dict(MOE_TEXT, mlp_only_layers=[1]), rope_parameters=dict(MROPE, mrope_interleaved=True)),
        vision_config=dict(VISION, intermediate_size=40, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
    ),
    "qwen3_5": dict(
        **QWEN_IDS,
        # Qwen3.5's hybrid decoder (tiny_configs.HYBRID), partial RoPE 0.5: 4 rotary frequencies over (t, h, w)
        text_config=dict(TEXT, **{k: v for k, v in HYBRID.items() if k != "rope_parameters"},
                         rope_parameters=dict(MROPE, mrope_section=[2, 1, 1], mrope_interleaved=True,
                                              partial_rotary_factor=0.5)),
        vision_config=dict(VISION, intermediate_size=40, out_hidden_size=64, num_position_embeddings=16),
    ),
    "qwen3_5_moe": dict(
        **QWEN_IDS,
        text_config=dict(TEXT, **{k: v for k, v in HYBRID.items() if k != "rope_parameters"},
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                         shared_expert_intermediate_size=24,
                         rope_parameters=dict(MROPE, mrope_section=[2, 1, 1], mrope_interleaved=True,
                                              partial_rotary_factor=0.5)),
        vision_config=dict(VISION, intermediate_size=40, out_hidden_size=64, num_position_embeddings=16),
    ),
    "glm4v": dict(
        **GLM_IDS,
        # partial rotary 0.5: 4 rotary frequencies per head
        text_config=dict(TEXT, rope_parameters=dict(MROPE, mrope_section=[2, 1, 1], partial_rotary_factor=0.5)),
        vision_config=dict(VISION, intermediate_size=40, out_hidden_size=64, image_size=16),
    ),
    "glm4v_moe": dict(
        **GLM_IDS,
        text_config=dict(TEXT, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                         routed_scaling_factor=1.0, norm_topk_prob=True,
                         rope_parameters=dict(MROPE, mrope_section=[2, 1, 1], partial_rotary_factor=0.5)),
        vision_config=dict(VISION, intermediate_size=40, out_hidden_size=64, image_size=16),
    ),
    # Vision part: patch 4 (pixel rows [3, 4, 4]), a 4x4 learned position table resampled to every grid, 3 time
    # embeddings, merge kernel 2x2 (the processors only make square ones). tie_word_embeddings as the model's
    # default (True: lm_head is the embedding matrix).
    "kimi_k25": dict(
        **QWEN_IDS, tie_word_embeddings=True, projection_hidden_size=32, projection_layer_norm_eps=1e-6,
        text_config=dict(TEXT, **TINY_CONFIGS["deepseek_v3"], rope_parameters=KIMI_YARN),
        vision_config=dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=3, num_attention_heads=2,
                           num_hidden_layers=2, hidden_size=32, intermediate_size=40, merge_kernel_size=[2, 2]),
    ),
}


def tiny_vlm_config(model_type: str, **overrides: Any):
    """A fresh config object (never shared between models: attention settings live on it)."""
    from transformers import AutoConfig

    if model_type not in TINY_VLM_CONFIGS:
        raise KeyError(f"no tiny VLM config for {model_type!r}; add one to actorcore.testing.tiny_vlm")
    kwargs = {**copy.deepcopy(TINY_VLM_CONFIGS[model_type]), **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def build_tiny_vlm(model_type: str, *, seed: int = 0, dtype=torch.float32, attn_implementation: str = "eager",
                   **overrides: Any):
    """Seeded random-weight ``...ForConditionalGeneration`` in eval mode."""
    from transformers import AutoModelForImageTextToText

    config = tiny_vlm_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def mixed_samples(model_or_config: Any, seed: int = 0, video: bool = True) -> list[SyntheticSample]:
    """The standard test mix: one image, text only, two images (different shapes), a video, text only."""
    g = torch.Generator().manual_seed(seed)
    samples = [
        synthetic_sample(model_or_config, images=[(4, 4)], text_lengths=(6, 9), generator=g),
        synthetic_sample(model_or_config, text_lengths=(17,), generator=g),
        synthetic_sample(model_or_config, images=[(4, 6), (2, 4)], text_lengths=(3, 2, 5), generator=g),
    ]
    if video:
        samples.append(synthetic_sample(model_or_config, video=(2, 4, 4), text_lengths=(4, 7), generator=g))
    samples.append(synthetic_sample(model_or_config, text_lengths=(2,), generator=g))
    return samples


def padded_processor_batch(samples: list[SyntheticSample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """What a processor returns for a right-padded batch: ``input_ids``, ``attention_mask``,
    ``mm_token_type_ids`` ``[B, S]`` (if the samples have them) and the visual inputs concatenated in sample order."""
    longest = max(int(s.input_ids.numel()) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    types = torch.zeros((len(samples), longest), dtype=torch.int32)
    with_types = all("mm_token_type_ids" in s.multimodal for s in samples)
    for i, s in enumerate(samples):
        n = int(s.input_ids.numel())
        ids[i, :n], mask[i, :n] = s.input_ids, 1
        if with_types:
            types[i, :n] = s.multimodal["mm_token_type_ids"]
    out: dict[str, torch.Tensor] = dict(input_ids=ids, attention_mask=mask)
    if with_types:
        out["mm_token_type_ids"] = types
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        parts = [s.multimodal[key] for s in samples if key in s.multimodal]
        if parts:
            out[key] = torch.cat(parts)
    return out
