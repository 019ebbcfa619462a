"""Embedded tiny models: seeded random-weight Hugging Face models built from configs; nothing is downloaded.

What ``actorcore demo`` runs on (and what ``actorcore.verify`` can be tried on without a checkpoint):

- ``build_text_model``: a Qwen3-shaped text model (4 layers, hidden 128, 4 heads, 2 kv heads, vocab 384), as a
  causal LM or as a 1-label critic (``...ForTokenClassification``).
- ``build_vlm``: a tiny Qwen2.5-VL. Text part: hidden 64, 4 heads, 2 kv heads, head dim 16, vocab 131, 2 layers;
  vision part: 2 blocks of width 32, patch 4, merge 2, so a ``[1, 4, 4]`` image grid is 4 image tokens.
- ``synthetic_sample``: what a processor returns for one sample of a tiny VLM: token ids with image / video
  placeholder runs laid out as the model's chat template lays them out (Qwen3-VL and GLM-4V put every video
  frame in its own run, separated by timestamp text), random ``pixel_values`` matching the grids, and
  ``mm_token_type_ids``.

The test suite's tiny VLM configs (``actorcore.testing.tiny_vlm``) are built from the blocks below, so every
number lives here once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

TEXT_MODEL_TYPE = "qwen3"
TEXT_MODEL: dict[str, Any] = dict(
    vocab_size=384, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False,
)

# Token ids of the tiny VLM vocabulary (131): ordinary text is drawn from [3, TEXT_VOCAB).
TEXT_VOCAB = 118
IMAGE_TOKEN, VIDEO_TOKEN = 127, 128
VISION_START, VISION_END = 125, 126
IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END = 121, 122, 123, 124
TIMESTAMP_TOKEN = 119  # stands for the "<t seconds>" text between video frames

VLM_TEXT: dict[str, Any] = dict(
    vocab_size=131, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
QWEN_VLM_IDS: dict[str, Any] = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                                    vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
VLM_VISION: dict[str, Any] = dict(depth=2, hidden_size=32, num_heads=2, in_channels=3, patch_size=4,
                                  spatial_merge_size=2, temporal_patch_size=2)
# head dim 16 -> 8 rotary frequencies split over (t, h, w)
MROPE: dict[str, Any] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
# Model types whose templates use GLM-4V's begin/end-of-image and -video markers (else Qwen's vision start/end).
GLM_MARKERS = ("glm4v", "glm4v_moe")

VLM_MODEL_TYPE = "qwen2_5_vl"
VLM: dict[str, Any] = dict(
    **QWEN_VLM_IDS,
    text_config=dict(VLM_TEXT, rope_parameters=MROPE),
    # window 16 px = 2 merged units: images of 8x8 patches have several attention windows
    vision_config=dict(VLM_VISION, intermediate_size=40, out_hidden_size=64, window_size=16,
                       fullatt_block_indexes=[1], tokens_per_second=2),
)


def build_text_model(*, seed: int = 0, task: str = "causal_lm", dtype: torch.dtype = torch.float32,
                     attn_implementation: str = "sdpa") -> Any:
    """The embedded text model in eval mode. ``task``: ``causal_lm`` or ``token_classification`` (a critic)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.for_model(TEXT_MODEL_TYPE, **TEXT_MODEL)
    if task == "token_classification":
        config.num_labels = 1
        auto = AutoModelForTokenClassification
    elif task == "causal_lm":
        auto = AutoModelForCausalLM
    else:
        raise ValueError(f"task must be 'causal_lm' or 'token_classification', got {task!r}")
    torch.manual_seed(seed)
    return auto.from_config(config, attn_implementation=attn_implementation, dtype=dtype).eval()


def build_vlm(*, seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager",
              **overrides: Any) -> Any:
    """The embedded tiny Qwen2.5-VL ``...ForConditionalGeneration`` in eval mode."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(VLM_MODEL_TYPE, **{**copy.deepcopy(VLM), **overrides})
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation, dtype=dtype).eval()


@dataclass(eq=False)  # compared by identity: tensors have no single truth value
class SyntheticSample:
    """One processor-like sample: ``input_ids [L]`` and its multimodal inputs (may be empty: text only)."""

    input_ids: torch.Tensor
    multimodal: dict[str, torch.Tensor] = field(default_factory=dict)


class _ConfigHolder:
    """Lets ``spec_for_model`` read a bare config."""

    def __init__(self, config: Any) -> None:
        self.config = config


def synthetic_sample(model_or_config: Any, *, images: list[tuple[int, int]] = (),
                     video: tuple[int, int, int] | None = None, text_lengths: tuple[int, ...] = (5, 3, 4),
                     generator: torch.Generator | None = None) -> SyntheticSample:
    """A sample with ``images`` (each ``(h, w)`` in patches) and optionally one ``video`` (``(t, h, w)``).

    Text runs of ``text_lengths`` go before, between and after the visual blocks (cycled). Grids must be
    multiples of the merge size. ``mm_token_type_ids`` marks image placeholders 1, video placeholders 2, all
    else 0 (GLM-4V's video frames use the image token id: only the type tells them apart). Pixel rows have the
    shape the model's tower takes (``VisionSpec.patch_row``); a model whose tower pools a grid's frames
    (Kimi-K2.5) gets one ``h*w/merge²`` placeholder run for the video.
    """
    from actorcore.archs import spec_for_model
    from actorcore.hf.vlm.packing import merge_kernel, patch_row_shape

    config = getattr(model_or_config, "config", model_or_config)
    vision = spec_for_model(_ConfigHolder(config)).vision
    kernel = merge_kernel(config, vision)
    row = patch_row_shape(vision, config.vision_config)
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
        pixels.append(torch.randn(h * w, *row, generator=g))
        add([start])
        add([image_token] * ((h // kernel[0]) * (w // kernel[1])), kind=1)
        add([end])
        text(i + 1)
    out: dict[str, torch.Tensor] = {}
    if grids:
        out["pixel_values"] = torch.cat(pixels)
        out["image_grid_thw"] = torch.tensor(grids)
    if video is not None:
        t, h, w = video
        frame_tokens = (h // kernel[0]) * (w // kernel[1])
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
            add([video_token] * (frame_tokens if vision.frames_pooled else t * frame_tokens), kind=2)
            add([end])
        out["pixel_values_videos"] = torch.randn(t * h * w, *row, generator=g)
        out["video_grid_thw"] = torch.tensor([[t, h, w]])
        if "second_per_grid_ts" in vision.rope_index_inputs:
            out["second_per_grid_ts"] = torch.tensor([1.5])
        text(len(images) + 1)
    if vision.token_types_input:  # Kimi-K2.5's processor returns none: packing derives them from the ids
        out["mm_token_type_ids"] = torch.cat(types)
    return SyntheticSample(input_ids=torch.cat(ids), multimodal=out)
