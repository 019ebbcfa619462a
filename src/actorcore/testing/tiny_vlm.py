"""Tiny seeded vision-language models and synthetic processor-like inputs (no downloads, no processors).

Text part: hidden 64, 4 heads, 2 kv heads, head dim 16, vocab 131, 2 layers (MoE: 4 experts, top-2). Vision
part: 2 blocks of width 32, patch 4, merge 2, so a ``[1, 4, 4]`` image grid is 4 image tokens.

``synthetic_sequence`` builds what a HF processor returns for one sample: token ids with image / video
placeholder runs laid out as the model's chat template lays them out (Qwen3-VL and GLM-4V put every video
frame in its own run, separated by timestamp text), random ``pixel_values`` matching the grids, and
``mm_token_type_ids``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

# Token ids of the tiny vocabulary (131): ordinary text is drawn from [3, TEXT_VOCAB).
TEXT_VOCAB = 118
IMAGE_TOKEN, VIDEO_TOKEN = 127, 128
VISION_START, VISION_END = 125, 126
IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END = 121, 122, 123, 124
TIMESTAMP_TOKEN = 119  # stands for the "<t seconds>" text between video frames

TEXT: dict[str, Any] = dict(
    vocab_size=131, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
MOE_TEXT: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, decoder_sparse_step=1,
                                mlp_only_layers=[])
QWEN_IDS: dict[str, Any] = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                                vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
GLM_IDS: dict[str, Any] = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, image_start_token_id=IMAGE_START,
                               image_end_token_id=IMAGE_END, video_start_token_id=VIDEO_START,
                               video_end_token_id=VIDEO_END)
VISION: dict[str, Any] = dict(depth=2, hidden_size=32, num_heads=2, in_channels=3, patch_size=4, spatial_merge_size=2,
                              temporal_patch_size=2)
# Model types whose templates use GLM-4V's begin/end-of-image and -video markers (else Qwen's vision start/end).
GLM_MARKERS = ("glm4v", "glm4v_moe")
# head dim 16 -> 8 rotary frequencies split over (t, h, w)
MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])

# One entry per registered VLM model_type: kwargs for ``AutoConfig.for_model``.
TINY_VLM_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": dict(
        **QWEN_IDS,
        text_config=dict(TEXT, rope_parameters=MROPE),
        vision_config=dict(VISION, embed_dim=32, mlp_ratio=2, hidden_size=64),
    ),
    "qwen2_5_vl": dict(
        **QWEN_IDS,
        text_config=dict(TEXT, rope_parameters=MROPE),
        # window 16 px = 2 merged units: images of 8x8 patches have several attention windows
        vision_config=dict(VISION, intermediate_size=40, out_hidden_size=64, window_size=16,
                           fullatt_block_indexes=[1], tokens_per_second=2),
    ),
    "qwen3_vl": dict(
        **QWEN_IDS,
        text_config=dict(TEXT, rope_parameters=dict(MROPE, mrope_interleaved=True)),
        vision_config=dict(VISION, intermediate_size=40, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
    ),
    "qwen3_vl_moe": dict(
        **QWEN_IDS,
        text_config=dict(TEXT, **MOE_TEXT, rope_parameters=dict(MROPE, mrope_interleaved=True)),
        vision_config=dict(VISION, intermediate_size=40, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
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


@dataclass(eq=False)  # compared by identity: tensors have no single truth value
class SyntheticSample:
    """One processor-like sample: ``input_ids [L]`` and its multimodal inputs (may be empty: text only)."""

    input_ids: torch.Tensor
    multimodal: dict[str, torch.Tensor] = field(default_factory=dict)


def _patch_dim(vision_config: Any) -> int:
    return int(vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size ** 2)


def synthetic_sample(model_or_config: Any, *, images: list[tuple[int, int]] = (),
                     video: tuple[int, int, int] | None = None, text_lengths: tuple[int, ...] = (5, 3, 4),
                     generator: torch.Generator | None = None) -> SyntheticSample:
    """A sample with ``images`` (each ``(h, w)`` in patches) and optionally one ``video`` (``(t, h, w)``).

    Text runs of ``text_lengths`` go before, between and after the visual blocks (cycled). Grids must be
    multiples of the merge size. ``mm_token_type_ids`` marks image placeholders 1, video placeholders 2, all
    else 0 (GLM-4V's video frames use the image token id: only the type tells them apart).
    """
    from actorcore.archs import spec_for_model

    config = getattr(model_or_config, "config", model_or_config)
    vision = spec_for_model(_ConfigHolder(config)).vision
    vc = config.vision_config
    merge = int(vc.spatial_merge_size)
    image_token = int(getattr(config, vision.image_token_field))
    video_token = int(getattr(config, vision.video_token_field))
    g = generator or torch.Generator().manual_seed(0)
    lengths = list(text_lengths) or [0]
    ids: list[torch.Tensor] = []
    types: list[torch.Tensor] = []

    def add(tokens: list[int], kind: int = 0) -> None:
        ids.append(torch.tensor(tokens, dtype=torch.long))
        types.append(torch.full((len(tokens),), kind, dtype=torch.int32))

    def text(i: int) -> None:
        add(torch.randint(3, TEXT_VOCAB, (lengths[i % len(lengths)],), generator=g).tolist())

    glm = config.model_type in GLM_MARKERS
    start, end = (IMAGE_START, IMAGE_END) if glm else (VISION_START, VISION_END)
    text(0)
    pixels: list[torch.Tensor] = []
    grids: list[list[int]] = []
    for i, (h, w) in enumerate(images):
        grids.append([1, h, w])
        pixels.append(torch.randn(h * w, _patch_dim(vc), generator=g))
        add([start])
        add([image_token] * (h * w // merge**2), kind=1)
        add([end])
        text(i + 1)
    out: dict[str, torch.Tensor] = {}
    if grids:
        out["pixel_values"] = torch.cat(pixels)
        out["image_grid_thw"] = torch.tensor(grids)
    if video is not None:
        t, h, w = video
        frame_tokens = h * w // merge**2
        if vision.video_frames_in_separate_runs:
            # "<t0> <start> frame0 <end> <t1> <start> frame1 <end> ...", GLM-4V inside its video markers
            if glm:
                add([VIDEO_START])
            for _ in range(t):
                add([TIMESTAMP_TOKEN, start])
                add([video_token] * frame_tokens, kind=2)
                add([end])
            if glm:
                add([VIDEO_END])
        else:
            add([start])
            add([video_token] * (t * frame_tokens), kind=2)
            add([end])
        out["pixel_values_videos"] = torch.randn(t * h * w, _patch_dim(vc), generator=g)
        out["video_grid_thw"] = torch.tensor([[t, h, w]])
        if "second_per_grid_ts" in vision.rope_index_inputs:
            out["second_per_grid_ts"] = torch.tensor([1.5])
        text(len(images) + 1)
    out["mm_token_type_ids"] = torch.cat(types)
    return SyntheticSample(input_ids=torch.cat(ids), multimodal=out)


class _ConfigHolder:
    """Lets ``spec_for_model`` read a bare config."""

    def __init__(self, config: Any) -> None:
        self.config = config


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
    ``mm_token_type_ids`` ``[B, S]`` and the visual inputs concatenated in sample order."""
    longest = max(int(s.input_ids.numel()) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    types = torch.zeros((len(samples), longest), dtype=torch.int32)
    for i, s in enumerate(samples):
        n = int(s.input_ids.numel())
        ids[i, :n], mask[i, :n], types[i, :n] = s.input_ids, 1, s.multimodal["mm_token_type_ids"]
    out: dict[str, torch.Tensor] = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=types)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        parts = [s.multimodal[key] for s in samples if key in s.multimodal]
        if parts:
            out[key] = torch.cat(parts)
    return out
