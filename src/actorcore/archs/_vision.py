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
# Layouts of one pixel row (``VisionSpec.patch_row``).
PATCH_ROWS = ("flat", "image")


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
    # (position_ids [3, 1, L], deltas). None: the model uses plain 1-D positions for every token, image and
    # video placeholders included (Kimi-K2.5), so a packed batch has ``[T]`` position ids, ``arange(L)`` per
    # sequence, as for a text model.
    rope_index: str | None = "get_rope_index"
    # Runs the vision tower (and projector): (pixels [P, *pixel row], grid_thw [I, 3]) -> output with
    # ``pooler_output`` (merged features, split per grid row). actorcore calls it ONCE per batch, on the images and the videos together
    # (each item attends only to itself inside the tower), so every rank issues the same collectives.
    image_features: str = "get_image_features"
    # GLM-4V's tower sees a video as single-frame grids ``[1, h, w]`` repeated ``t`` times (its
    # ``get_video_features`` flattens them); the Qwen towers take ``[t, h, w]`` as is.
    video_tower_grids_per_frame: bool = False
    # The vision config's merge field: an int (Qwen, GLM: ``spatial_merge_size``) or an ``(h, w)`` pair
    # (Kimi-K2.5: ``merge_kernel_size``); a grid's height and width must be multiples of it.
    merge_field: str = "spatial_merge_size"
    # Kimi-K2.5's tower averages the ``t`` frames of a grid into one: a grid ``[t, h, w]`` yields
    # ``h*w/merge²`` features (one placeholder run) instead of Qwen's ``t*h*w/merge²``.
    frames_pooled: bool = False
    # The shape of one pixel row (one patch): "flat": ``[in_channels * temporal_patch_size * patch_size²]``
    # (Qwen, GLM); "image": ``[3, patch_size, patch_size]`` (Kimi-K2.5's Conv2d patch embedding).
    patch_row: str = "flat"
    # Whether the model's forward takes ``mm_token_type_ids`` (the Qwen / GLM processors return it; Kimi-K2.5's
    # has none). actorcore's packed batch always carries them; the reference forward gets them only if true.
    token_types_input: bool = True
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
    # Rows of the M-RoPE position ids (temporal, height, width); unused when ``rope_index`` is None.
    position_rows: int = 3
    # A projector beside the tower (Kimi-K2.5: ``mm_projector``, relative to ``base_model``): the class of the
    # family's modeling module that builds it from the whole config. The Megatron route then holds tower and
    # projector as one module and runs the model's own ``image_features`` method on them.
    projector: str | None = None
    projector_class: str | None = None
    # The name under which the checkpoints store each tower attention's q, k and v fused (Kimi-K2.5: ``wqkv``,
    # q and k rows interleaved per head); the Megatron route's tower then holds that tensor as the parameter.
    tower_fused_qkv: str | None = None
    # Set for architectures registered only to be refused (with this reason).
    refused: str | None = None

    def __post_init__(self) -> None:
        if self.patch_row not in PATCH_ROWS:
            raise ValueError(f"VisionSpec.patch_row {self.patch_row!r} is not one of {PATCH_ROWS}")
