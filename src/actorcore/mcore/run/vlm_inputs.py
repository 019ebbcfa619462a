"""One packed micro-batch of a vision-language model on the Megatron route: the decoder input (word embeddings with the
vision tower's features at the placeholder tokens, ``actorcore.visual_merge``) and the DeepStack additions, then the
chunk's forward (the tower and the DeepStack layers are built by ``mcore/build/vlm.py``, which says why the tower is
replicated on every tensor-parallel rank).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from actorcore.archs import get_spec
from actorcore.archs.megatron_rules import VISION_TOWER
from actorcore.visual_merge import VisualFeatures, merge_visual_features, scatter_features, tower_outputs


def _tower_outputs(tower: torch.nn.Module, pixels: torch.Tensor, grid_I3: torch.Tensor, deepstack: bool
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Merged tower features ``[N, D]`` of every image (or video) of the batch, in order, and the deepstack
    features (one ``[N, D]`` per deepstack layer; none for towers without): one tower call."""
    out = tower(pixels.to(next(tower.parameters()).dtype), grid_thw=grid_I3)
    return tower_outputs(out, f"the vision tower ({type(tower).__name__})", deepstack)


def _full_sequence(chunk: Any, embeds_T1D: torch.Tensor) -> torch.Tensor:
    """Under sequence parallelism Megatron's embedding returns this rank's ``T / tp`` tokens: every token (the
    backward keeps this rank's slice of the gradient, which the embedding's own backward gathers again)."""
    if not chunk.config.sequence_parallel:
        return embeds_T1D
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(embeds_T1D, tensor_parallel_output_grad=False)


def _this_rank_tokens(chunk: Any, full_T1D: torch.Tensor) -> torch.Tensor:
    """Under sequence parallelism this rank's ``T / tp`` tokens (the backward gathers every rank's gradient, so the
    replicated vision tower gets the whole gradient on every TP rank); otherwise all of them."""
    if not chunk.config.sequence_parallel:
        return full_T1D
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(full_T1D)


def vlm_inputs(chunk: Any, batch: Any, config: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The decoder input (word embeddings with the tower's features at the placeholder tokens: the HF route's merge,
    ``actorcore.visual_merge``) and, for deepstack, what each of the first decoder layers adds (the deepstack
    features at the visual tokens, 0 elsewhere), both ``[T, 1, D]`` (``[T / tp, 1, D]`` under sequence parallelism;
    ``config``: the VLM's HF config). The tower runs once over the batch's images and once over its videos."""
    ids_T = batch.input_ids
    embeds = _full_sequence(chunk, chunk.embedding(input_ids=ids_T.unsqueeze(0), position_ids=None))
    tower = getattr(chunk, VISION_TOWER)
    vision = get_spec(config.model_type).vision
    features, masks = VisualFeatures(), {}
    for kind, pixels_key, grid_key, token_field in (
            ("image", "pixel_values", "image_grid_thw", vision.image_token_field),
            ("video", "pixel_values_videos", "video_grid_thw", vision.video_token_field)):
        masks[kind] = torch.zeros_like(ids_T, dtype=torch.bool) if token_field is None else \
            ids_T == int(getattr(config, token_field))
        pixels = batch.multimodal.get(pixels_key)
        if token_field is None or pixels is None:
            continue
        merged, deepstack = _tower_outputs(tower, pixels, batch.multimodal[grid_key], vision.deepstack)
        setattr(features, f"{kind}_ND", merged)
        setattr(features, f"deepstack_{kind}", deepstack)
    embeds, deepstack = merge_visual_features(embeds, masks["image"], masks["video"], features)
    if deepstack is None:
        return _this_rank_tokens(chunk, embeds), None
    visual_T, joint = deepstack
    deltas = tuple(_this_rank_tokens(chunk, scatter_features(torch.zeros_like(embeds), visual_T, layer_ND, "visual"))
                   for layer_ND in joint)
    return _this_rank_tokens(chunk, embeds), deltas


def vlm_chunk_forward(chunk: Any, batch: Any, params: Any, config: Any) -> torch.Tensor:
    """One chunk's forward on a packed VLM batch (positions ``[3, T]``, or ``[T]`` for a model with 1-D positions)
    of the VLM ``config``; what ``GPTModel.forward`` returns."""
    rows = 1 if get_spec(config.model_type).vision.rope_index is None else 2
    if batch.position_ids.dim() != rows:
        raise ValueError(f"a {config.model_type} batch on the Megatron route needs its "
                         f"{'[T]' if rows == 1 else '[3, T] M-RoPE'} position ids, got shape "
                         f"{list(batch.position_ids.shape)}: pack it with actorcore.pack(sequences, multimodal=..., "
                         "model=hf_model)")
    decoder_input = None
    if chunk.pre_process:
        decoder_input, deepstack = vlm_inputs(chunk, batch, config)
        if deepstack is not None:
            params = dataclasses.replace(params, deepstack=deepstack)
    positions = batch.position_ids.unsqueeze(0 if rows == 1 else 1)
    return chunk(batch.input_ids.unsqueeze(0), positions, None, decoder_input=decoder_input,
                 packed_seq_params=params)
