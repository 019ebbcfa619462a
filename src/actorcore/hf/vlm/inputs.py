"""Decoder inputs for vision-language models on packed batches (run by the ``VisionInputs`` decoder feature,
``hf.features.vision_inputs``).

Legend: ``T`` tokens of the packed batch as run (padding for SP included), ``D`` text hidden size, ``N``
visual tokens (image and video placeholders) of the batch.

Order of work, the same on every rank of an SP group:
1. the vision tower runs once over all images and videos of the batch together (never
   sequence-parallel: every rank runs it on the same inputs, so the features agree). A batch without images
   or videos skips it on every rank of the SP group (they share the batch), unless ranks may disagree about
   running it: when the tower's parameters are FSDP2-sharded (its forward all-gathers them) or the context
   has a data-parallel axis, it then runs on one dummy image whose features enter the embeddings multiplied
   by 0, so every rank issues the same collectives and no rank hangs (the result is unchanged);
2. the features replace the placeholder embeddings of the FULL packed sequence (``masked_scatter`` in
   packed order, which is sequence order, which is the order of the processor outputs: ``actorcore.visual_merge``,
   the merge the Megatron route runs too);
3. only then the embeddings, and Qwen3-VL's DeepStack inputs (visual-position mask and per-layer visual
   features), are cut to this rank's contiguous token shard. Position ids were computed per sequence at
   packing time (``actorcore.hf.vlm.packing``) and the packed pass shards them.

Gradients: each rank's shard of the embeddings back-propagates into the shared vision-tower output, so the
vision tower's parameter gradients, summed (or averaged, under the SP gradient contract) over the group, are
the single-process gradients, like every decoder parameter's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from actorcore.archs import ArchSpec, submodule
from actorcore.archs._vision import VisionSpec
from actorcore.batch import PackedBatch, shard_bounds
from actorcore.hf.vlm.packing import (
    IMAGE,
    TOKEN_TYPES_KEY,
    VIDEO,
    check_grid,
    grid_tokens,
    merge_kernel,
    patch_row_shape,
    token_types,
    vision_spec,
)
from actorcore.visual_merge import VisualFeatures, merge_visual_features, tower_outputs

logger = logging.getLogger(__name__)


def _run_tower(base: Any, method: str, pixels: torch.Tensor, grid: torch.Tensor,
               vision: VisionSpec) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return tower_outputs(getattr(base, method)(pixels, grid), f"{type(base).__name__}.{method}", vision.deepstack)


def tower_grids(video_grid_I3: torch.Tensor, vision: VisionSpec) -> torch.Tensor:
    """The grids the tower sees for videos (GLM-4V: one ``[1, h, w]`` grid per frame)."""
    if not vision.video_tower_grids_per_frame:
        return video_grid_I3
    frames = torch.repeat_interleave(video_grid_I3[:, 1:], video_grid_I3[:, 0], dim=0)
    return torch.cat([frames.new_ones(frames.shape[0], 1), frames], dim=1)


def visual_features(base: Any, vision: VisionSpec, multimodal: dict[str, Any]) -> VisualFeatures:
    """One vision-tower call over every image and then every video of the batch (none if there are none).

    Images and videos go through the tower together: each item attends only to itself there, so this equals
    separate image and video calls, and every rank (and every FSDP shard) runs the tower the same number of
    times. The merged rows are split back: image tokens first, then video tokens.
    """
    kernel = merge_kernel(base.config, vision)
    row_shape = patch_row_shape(vision, base.config.vision_config)
    pixels, grids = [], []
    for name, patch_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                      ("video", "pixel_values_videos", "video_grid_thw")):
        if multimodal.get(patch_key) is None and multimodal.get(grid_key) is None:
            continue
        if multimodal.get(patch_key) is None:
            raise ValueError(f"batch: {grid_key} given without {patch_key}")
        check_grid(multimodal.get(grid_key), multimodal[patch_key], kernel, name, "batch", row_shape)
        pixels.append(multimodal[patch_key])
        grids.append(multimodal[grid_key] if name == "image" else tower_grids(multimodal[grid_key], vision))
    if not pixels:
        return VisualFeatures()
    merged_ND, deepstack = _run_tower(base, vision.image_features, torch.cat(pixels), torch.cat(grids), vision)
    image_rows = 0
    if multimodal.get("image_grid_thw") is not None:
        image_rows = int(grid_tokens(multimodal["image_grid_thw"], kernel, vision).sum())
    has_images, has_videos = multimodal.get("pixel_values") is not None, multimodal.get("pixel_values_videos") is not None
    return VisualFeatures(
        image_ND=merged_ND[:image_rows] if has_images else None,
        video_ND=merged_ND[image_rows:] if has_videos else None,
        deepstack_image=[layer[:image_rows] for layer in deepstack] if has_images else [],
        deepstack_video=[layer[image_rows:] for layer in deepstack] if has_videos else [],
    )


def tower_must_run(base: Any, vision: VisionSpec, parallel: Any) -> bool:
    """Whether a batch without images must still run the vision tower (see the module docstring)."""
    from torch.distributed.tensor import DTensor

    if parallel is not None and int(getattr(parallel, "dp_size", 1)) > 1:
        return True
    return any(isinstance(p, DTensor) for p in submodule(base, vision.tower).parameters())


def dummy_visual_term(base: Any, vision: VisionSpec, config: Any) -> torch.Tensor:
    """``0 * (features of one minimal blank image)``: a scalar zero that depends on every tower parameter."""
    kernel = merge_kernel(config, vision)
    grid = torch.tensor([[1, *kernel]], device=base.device)
    pixels = torch.zeros(kernel[0] * kernel[1], *patch_row_shape(vision, config.vision_config), device=base.device)
    merged, deepstack = _run_tower(base, vision.image_features, pixels, grid, vision)
    return 0.0 * (merged.sum() + sum(layer.sum() for layer in deepstack))


def token_types_of(model: Any, vision: VisionSpec, work: PackedBatch) -> torch.Tensor:
    """``[T]`` token types of the batch as run (the SP padding segment is text).

    A batch packed without ``mm_token_type_ids`` (``actorcore.pack`` of text) gets them from the placeholder
    token ids, so placeholders without pixels are still caught as a token/feature mismatch.
    """
    types = work.multimodal.get(TOKEN_TYPES_KEY)
    if types is None:
        has_video = work.multimodal.get("pixel_values_videos") is not None
        types = token_types(work.input_ids[: work.num_real_tokens], None, has_video, model.config, vision, "batch")
    if types.numel() > work.num_tokens:
        raise ValueError(f"mm_token_type_ids has {types.numel()} entries for {work.num_tokens} tokens")
    return torch.nn.functional.pad(types.to(work.device), (0, work.num_tokens - types.numel()))


def vlm_decoder_inputs(model: Any, spec: ArchSpec, work: PackedBatch, parallel: Any) -> dict[str, Any]:
    """Keyword arguments for the language model: this rank's ``inputs_embeds`` (and DeepStack inputs)."""
    vision = vision_spec(model)
    base = submodule(model, vision.base_model)
    types_T = token_types_of(model, vision, work)
    image_mask_T, video_mask_T = types_T == IMAGE, types_T == VIDEO
    features = visual_features(base, vision, work.multimodal)
    embeds_TD = model.get_input_embeddings()(work.input_ids)
    if features.image_ND is None and features.video_ND is None and tower_must_run(base, vision, parallel):
        embeds_TD = embeds_TD + dummy_visual_term(base, vision, model.config).to(embeds_TD.dtype)
    embeds_TD, deepstack = merge_visual_features(embeds_TD, image_mask_T, video_mask_T, features)
    has_deepstack = deepstack is not None
    if has_deepstack:
        visual_T, deepstack_ND = deepstack

    sp_size = 1 if parallel is None else int(parallel.sp_size)
    if sp_size > 1:
        start, end = shard_bounds(work.num_tokens, int(parallel.sp_rank), sp_size)
        embeds_TD = embeds_TD[start:end]
        if has_deepstack:
            before = int(visual_T[:start].sum())
            local = int(visual_T[start:end].sum())
            deepstack_ND = [layer[before: before + local] for layer in deepstack_ND]
            visual_T = visual_T[start:end]
    kwargs: dict[str, Any] = {"inputs_embeds": embeds_TD.unsqueeze(0)}
    if has_deepstack:
        kwargs["visual_pos_masks"] = visual_T.unsqueeze(0)
        kwargs["deepstack_visual_embeds"] = deepstack_ND
    return kwargs

