"""``VisionSpec``: what generic code needs to know about a vision-language model, as data.

Imported by the VLM arch specs (``archs/qwen2_vl.py``, ...); importable without torch or transformers.
The leading underscore keeps the arch registry from reading this module as a ``model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Keys of a processor's output, by what their rows are: rows of image patches / images / videos.
IMAGE_PATCH_KEYS = ("pixel_values",)
IMAGE_KEYS = ("image_grid_thw",)
VIDEO_PATCH_KEYS = ("pixel_values_videos",)
VIDEO_KEYS = ("video_grid_thw", "second_per_grid_ts")


@dataclass(frozen=True)
class VisionSpec:
    """Declarative facts about the vision side of one VLM ``model_type``.

    Paths and method names are relative to ``base_model`` (the ``...Model`` that owns the vision tower and the
    language model), itself a dotted path from the task model (``...ForConditionalGeneration``).
    """

    base_model: str = "model"
    # The vision tower module (relative to ``base_model``) and its config (relative to the task model's config).
    tower: str = "visual"
    # The model's own per-sequence M-RoPE function: (input_ids [1, L], mm_token_type_ids [1, L], grids) ->
    # (position_ids [3, 1, L], deltas).
    rope_index: str = "get_rope_index"
    # Runs the vision tower: (pixels [P, C*t*p*p], grid_thw [I, 3]) -> output with ``pooler_output`` (merged
    # features, split per grid row). actorcore calls it ONCE per batch, on the images and the videos together
    # (each item attends only to itself inside the tower), so every rank issues the same collectives.
    image_features: str = "get_image_features"
    # GLM-4V's tower sees a video as single-frame grids ``[1, h, w]`` repeated ``t`` times (its
    # ``get_video_features`` flattens them); the Qwen towers take ``[t, h, w]`` as is.
    video_tower_grids_per_frame: bool = False
    image_token_field: str = "image_token_id"
    video_token_field: str | None = "video_token_id"
    # Extra per-video inputs the rope-index function reads (Qwen2.5-VL: seconds per temporal grid step).
    rope_index_inputs: tuple[str, ...] = ()
    # Qwen3-VL: the vision tower also returns per-layer "deepstack" features, added to the hidden states of
    # the first decoder layers at the visual positions (the language model's ``visual_pos_masks`` /
    # ``deepstack_visual_embeds`` inputs).
    deepstack: bool = False
    # Qwen3-VL and GLM-4V give every video frame its own placeholder run (timestamps between frames); the
    # rope-index function then splits each video grid into ``t`` single-frame grids.
    video_frames_in_separate_runs: bool = False
    # Rows of the M-RoPE position ids (temporal, height, width).
    position_rows: int = 3
    # Set for architectures registered only to be refused (with this reason).
    refused: str | None = None
