"""Packed batches for vision-language models: sequences with their processor outputs.

Legend for shape suffixes: ``T`` tokens of the packed batch, ``L`` tokens of one sequence, ``P`` image or
video patches, ``I`` images or videos, ``B`` sequences, ``S`` padded length.

``pack_multimodal`` packs token sequences like ``actorcore.batch.pack`` and, per sequence, the inputs a Hugging Face
processor returns for it (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
``second_per_grid_ts``, ``mm_token_type_ids``). Position ids are the model's own M-RoPE positions
(``[3, T]``), computed one sequence at a time with the model's rope-index function, so they restart in every
sequence exactly as in a padded forward; a model without M-RoPE (``VisionSpec.rope_index`` None: Kimi-K2.5)
gets ``[T]`` positions, ``arange(L)`` per sequence. Visual inputs are concatenated in sequence order into
``PackedBatch.multimodal``, with ``mm_token_type_ids`` as one ``[T]`` tensor (0 text, 1 image, 2 video).
Every count is checked here, before any model runs: pixels against grids, placeholder tokens against the
features the grids will produce, placeholder runs against images and video frames.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Mapping, Sequence

import torch

from actorcore.archs._vision import IMAGE_KEYS, IMAGE_PATCH_KEYS, VIDEO_KEYS, VIDEO_PATCH_KEYS, VisionSpec
from actorcore.archs import UnsupportedArchitectureError, spec_for_model, submodule
from actorcore.batch import PackedBatch, check_mask, pack

TOKEN_TYPES_KEY = "mm_token_type_ids"
TEXT, IMAGE, VIDEO = 0, 1, 2
MULTIMODAL_KEYS = IMAGE_PATCH_KEYS + IMAGE_KEYS + VIDEO_PATCH_KEYS + VIDEO_KEYS + (TOKEN_TYPES_KEY,)


def vision_spec(model: Any) -> VisionSpec:
    """The model's ``VisionSpec``; refused and text-only architectures raise clear errors."""
    spec = spec_for_model(model)
    if spec.vision is None:
        raise ValueError(f"{spec.model_type} is a text model; pack its sequences with actorcore.pack / pack_padded")
    if spec.vision.refused:
        raise UnsupportedArchitectureError(f"{spec.model_type}: {spec.vision.refused}")
    return spec.vision


def merge_kernel(config: Any, vision: VisionSpec) -> tuple[int, int]:
    """The ``(height, width)`` merge kernel from the vision config's ``vision.merge_field`` (an int or a pair)."""
    value = getattr(config.vision_config, vision.merge_field)
    kernel = (int(value), int(value)) if isinstance(value, int) else tuple(int(v) for v in value)
    if len(kernel) != 2 or min(kernel) <= 0:
        raise ValueError(f"vision_config.{vision.merge_field} is {value!r}; expected a positive int or a "
                         "positive (height, width) pair")
    return kernel


def grid_tokens(grid_I3: torch.Tensor, kernel: tuple[int, int], vision: VisionSpec) -> torch.Tensor:
    """``[I]`` features (placeholder tokens) each grid row yields: ``t*h*w/merge²``, or ``h*w/merge²`` when
    the tower pools a grid's frames (``vision.frames_pooled``)."""
    frames = torch.ones_like(grid_I3[:, 0]) if vision.frames_pooled else grid_I3[:, 0]
    return frames * (grid_I3[:, 1] // kernel[0]) * (grid_I3[:, 2] // kernel[1])


def patch_row_shape(vision: VisionSpec, vision_config: Any) -> tuple[int, ...]:
    """The shape of one pixel row (one patch) the tower takes (``vision.patch_row``)."""
    patch = int(vision_config.patch_size)
    if vision.patch_row == "image":
        return (3, patch, patch)
    return (int(vision_config.in_channels * vision_config.temporal_patch_size * patch**2),)


def _as_1d(x: torch.Tensor, length: int, what: str) -> torch.Tensor:
    if x.dim() == 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 1 or x.shape[0] != length:
        raise ValueError(f"{what} has shape {tuple(x.shape)}; expected [{length}] (one entry per token)")
    return x


def token_types(ids_L: torch.Tensor, given: Any, has_video: bool, config: Any, vision: VisionSpec,
                where: str) -> torch.Tensor:
    """``mm_token_type_ids`` of one sequence ``[L]``: ``given`` (checked against the ids), or derived from the
    placeholder ids when they tell images and videos apart."""
    image_id = int(getattr(config, vision.image_token_field))
    video_id = int(getattr(config, vision.video_token_field)) if vision.video_token_field else None
    if given is None:
        if video_id == image_id and has_video:
            raise ValueError(f"{where}: this model writes video frames with the image token, so only "
                             "mm_token_type_ids tells them apart; pass the processor's mm_token_type_ids")
        types = torch.zeros_like(ids_L, dtype=torch.int32)
        types[ids_L == image_id] = IMAGE
        if video_id is not None and video_id != image_id:
            types[ids_L == video_id] = VIDEO
        return types
    types = _as_1d(torch.as_tensor(given, device=ids_L.device), ids_L.numel(), f"{where}: mm_token_type_ids")
    bad = ~torch.isin(types, torch.tensor([TEXT, IMAGE, VIDEO], device=types.device, dtype=types.dtype))
    if bool(bad.any()):
        raise ValueError(f"{where}: mm_token_type_ids holds {sorted(set(types[bad].tolist()))}; only 0 (text), "
                         "1 (image) and 2 (video) are known")
    for kind, token, name in ((IMAGE, image_id, "image"), (VIDEO, video_id, "video")):
        if token is not None and not bool((ids_L[types == kind] == token).all()):
            raise ValueError(f"{where}: tokens marked {name} in mm_token_type_ids are not all the {name} "
                             f"placeholder token {token}")
    untyped = (types == TEXT) & ((ids_L == image_id) | ((ids_L == video_id) if video_id is not None else False))
    if bool(untyped.any()):
        raise ValueError(f"{where}: {int(untyped.sum())} image/video placeholder tokens are marked as text in "
                         "mm_token_type_ids")
    return types.to(torch.int32)


def _has_video(inputs: Mapping[str, Any]) -> bool:
    return any(inputs.get(k) is not None for k in VIDEO_PATCH_KEYS)


def _runs(types_L: torch.Tensor, kind: int) -> list[int]:
    """Lengths of the runs of ``kind`` in order."""
    return [len(list(group)) for key, group in itertools.groupby(types_L.tolist()) if key == kind]


def check_grid(grid_I3: torch.Tensor | None, pixels_P: torch.Tensor | None, kernel: tuple[int, int], name: str,
               where: str, row_shape: tuple[int, ...] | None = None) -> None:
    """Grids are ``[I, 3]``, positive, spatially divisible by the merge kernel, and describe the pixel rows
    (their number, and with ``row_shape`` the shape of each)."""
    if grid_I3 is None:
        raise ValueError(f"{where}: {name} pixels given without {name}_grid_thw")
    if grid_I3.dim() != 2 or grid_I3.shape[1] != 3:
        raise ValueError(f"{where}: {name}_grid_thw has shape {tuple(grid_I3.shape)}; expected [num_{name}s, 3]")
    if bool((grid_I3 <= 0).any()) or bool((grid_I3[:, 1] % kernel[0] != 0).any()) or bool(
            (grid_I3[:, 2] % kernel[1] != 0).any()):
        merge = kernel[0] if kernel[0] == kernel[1] else kernel
        raise ValueError(f"{where}: {name}_grid_thw {grid_I3.tolist()} must be positive with height and width "
                         f"multiples of the spatial merge size {merge}")
    patches = int(grid_I3.prod(-1).sum())
    if pixels_P is None:
        raise ValueError(f"{where}: {name}_grid_thw given without its pixels")
    if pixels_P.shape[0] != patches:
        raise ValueError(f"{where}: {name} grids {grid_I3.tolist()} describe {patches} patches but the pixel "
                         f"tensor has {pixels_P.shape[0]} rows; grids and pixels must come from the same "
                         "processor call")
    if row_shape is not None and tuple(pixels_P.shape[1:]) != tuple(row_shape):
        raise ValueError(f"{where}: {name} pixel rows have shape {tuple(pixels_P.shape[1:])} but this model's "
                         f"vision tower takes rows of shape {tuple(row_shape)}; pass the pixels of this model's "
                         "own processor")


def _expected_runs(grid_I3: torch.Tensor, kernel: tuple[int, int], vision: VisionSpec,
                   frames_separate: bool) -> list[int]:
    if not frames_separate:
        return grid_tokens(grid_I3, kernel, vision).tolist()
    runs = []
    for t, h, w in grid_I3.tolist():
        runs.extend([(h // kernel[0]) * (w // kernel[1])] * t)
    return runs


def check_sequence(ids_L: torch.Tensor, types_L: torch.Tensor, inputs: Mapping[str, Any], config: Any,
                   vision: VisionSpec, where: str) -> None:
    """Pixels match grids, and the placeholder runs match the features the grids produce, in order."""
    unknown = set(inputs) - set(MULTIMODAL_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown multimodal inputs {sorted(unknown)}; known: {list(MULTIMODAL_KEYS)}")
    kernel, row_shape = merge_kernel(config, vision), patch_row_shape(vision, config.vision_config)
    for name, patch_key, grid_key, kind, separate in (
        ("image", "pixel_values", "image_grid_thw", IMAGE, False),
        ("video", "pixel_values_videos", "video_grid_thw", VIDEO, vision.video_frames_in_separate_runs),
    ):
        grid, pixels = inputs.get(grid_key), inputs.get(patch_key)
        runs = _runs(types_L, kind)
        if grid is None:
            if pixels is not None:
                raise ValueError(f"{where}: {patch_key} given without {grid_key}")
            if runs:
                raise ValueError(f"{where}: {sum(runs)} {name} tokens but no {name} inputs ({patch_key}, "
                                 f"{grid_key}): image tokens and features do not match")
            continue
        check_grid(grid, pixels, kernel, name, where, row_shape)
        expected = _expected_runs(grid, kernel, vision, separate)
        if sum(runs) != sum(expected):
            raise ValueError(f"{where}: {sum(runs)} {name} tokens but the {name} grids {grid.tolist()} give "
                             f"{sum(expected)} features: {name} tokens and features do not match")
        if runs != expected:
            frame = " (one run per video frame)" if separate else ""
            raise ValueError(f"{where}: {name} placeholder runs have lengths {runs} but the grids need {expected}"
                             f"{frame}; separate consecutive {name}s by at least one text token")
    seconds = inputs.get("second_per_grid_ts")
    if seconds is not None and inputs.get("video_grid_thw") is not None:
        if torch.as_tensor(seconds).numel() != inputs["video_grid_thw"].shape[0]:
            raise ValueError(f"{where}: second_per_grid_ts needs one entry per video")


def rope_positions(model: Any, vision: VisionSpec, ids_L: torch.Tensor, types_L: torch.Tensor,
                   inputs: Mapping[str, Any]) -> torch.Tensor:
    """``[3, L]`` M-RoPE position ids of one sequence, from the model's own rope-index function.

    A sequence without images or videos gets ``arange(L)`` on every row, which is what the rope-index
    function returns for it and what the model uses for text. A model without M-RoPE (``vision.rope_index``
    None) gets ``[L]`` positions ``arange(L)``, what its forward uses without ``position_ids``.
    """
    if vision.rope_index is None:
        return torch.arange(ids_L.numel(), device=ids_L.device)
    if inputs.get("image_grid_thw") is None and inputs.get("video_grid_thw") is None:
        return torch.arange(ids_L.numel(), device=ids_L.device).expand(vision.position_rows, -1).clone()
    base = submodule(model, vision.base_model)
    extra = {k: inputs[k] for k in vision.rope_index_inputs if inputs.get(k) is not None}
    grids = {k: (inputs[k].clone() if inputs.get(k) is not None else None) for k in ("image_grid_thw", "video_grid_thw")}
    position_3BL, _ = getattr(base, vision.rope_index)(ids_L[None], mm_token_type_ids=types_L[None], **grids,
                                                     attention_mask=None, **extra)
    if tuple(position_3BL.shape) != (vision.position_rows, 1, ids_L.numel()):
        raise ValueError(f"{type(base).__name__}.{vision.rope_index} returned position ids of shape "
                         f"{tuple(position_3BL.shape)}; expected {(vision.position_rows, 1, ids_L.numel())}")
    return position_3BL[:, 0].to(torch.long)


def _concat(parts: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.cat(parts) if parts else None


def pack_multimodal(model: Any, sequences: Sequence[torch.Tensor],
                    multimodal: Sequence[Mapping[str, Any] | None]) -> PackedBatch:
    """Pack 1-D id tensors with each sequence's processor outputs (``None`` or ``{}`` for text only).

    Returns a ``PackedBatch`` with ``[3, T]`` M-RoPE position ids (``[T]`` without M-RoPE) and the visual inputs concatenated in
    sequence order in ``multimodal``. ``model`` is the ``...ForConditionalGeneration`` (its rope-index
    function and config are used; no forward pass runs).
    """
    vision = vision_spec(model)
    if len(multimodal) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(multimodal)} multimodal inputs; pass one dict "
                         "(or None) per sequence")
    batch = pack(sequences)
    config = model.config
    positions, types_all = [], []
    merged: dict[str, list[torch.Tensor]] = {k: [] for k in MULTIMODAL_KEYS if k != TOKEN_TYPES_KEY}
    for i, (ids, inputs) in enumerate(zip(sequences, multimodal)):
        where = f"sequence {i}"
        inputs = {k: torch.as_tensor(v) for k, v in (inputs or {}).items() if v is not None}
        ids = ids.to(device=batch.device, dtype=torch.long)
        types = token_types(ids, inputs.get(TOKEN_TYPES_KEY), _has_video(inputs), config, vision, where)
        types = types.to(batch.device)
        check_sequence(ids, types, inputs, config, vision, where)
        positions.append(rope_positions(model, vision, ids, types, inputs))
        types_all.append(types)
        for key in merged:
            if key in inputs:
                merged[key].append(inputs[key].to(batch.device))
    packed_mm: dict[str, Any] = {k: _concat(v) for k, v in merged.items() if v}
    packed_mm[TOKEN_TYPES_KEY] = torch.cat(types_all)
    return dataclasses.replace(batch, position_ids=torch.cat(positions, dim=-1), multimodal=packed_mm)


def split_rows(grid_tokens_I: list[int], tokens_per_row: list[int], name: str) -> list[slice]:
    """Which grids belong to which row: consume grids (``grid_tokens_I``: the tokens each yields) in order until
    their tokens fill the row's count."""
    slices, start = [], 0
    counts = list(grid_tokens_I)
    for row, need in enumerate(tokens_per_row):
        end, have = start, 0
        while have < need and end < len(counts):
            have += counts[end]
            end += 1
        if have != need:
            raise ValueError(f"row {row} has {need} {name} tokens, which the {name} grids (in order) do not "
                             f"cover exactly: {name} tokens and features do not match")
        slices.append(slice(start, end))
        start = end
    if start != len(counts):
        raise ValueError(f"{len(counts) - start} {name} grids are left over after every row's {name} tokens "
                         f"were matched: {name} tokens and features do not match")
    return slices


def pack_multimodal_padded(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           **processor_outputs: Any) -> PackedBatch:
    """Pack a left- or right-padded ``[B, S]`` processor batch (visual inputs concatenated over rows)."""
    vision = vision_spec(model)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    mask = check_mask(attention_mask, input_ids)
    config = model.config
    kernel, row_shape = merge_kernel(config, vision), patch_row_shape(vision, config.vision_config)
    processor_outputs = {k: v for k, v in processor_outputs.items() if v is not None}
    types_BS = processor_outputs.pop(TOKEN_TYPES_KEY, None)
    rows_ids = [row[keep] for row, keep in zip(input_ids, mask)]
    rows_types = []
    for b, ids in enumerate(rows_ids):
        given = None if types_BS is None else torch.as_tensor(types_BS)[b][mask[b]]
        rows_types.append(token_types(ids, given, _has_video(processor_outputs), config, vision, f"row {b}"))
    per_row: list[dict[str, Any]] = [{TOKEN_TYPES_KEY: t} for t in rows_types]
    for name, patch_key, grid_key, row_keys, kind in (
        ("image", "pixel_values", "image_grid_thw", IMAGE_KEYS, IMAGE),
        ("video", "pixel_values_videos", "video_grid_thw", VIDEO_KEYS, VIDEO),
    ):
        grid = processor_outputs.get(grid_key)
        pixels = processor_outputs.get(patch_key)
        if grid is not None:
            check_grid(grid, pixels, kernel, name, "batch", row_shape)
        counts = [] if grid is None else grid_tokens(grid, kernel, vision).tolist()
        slices = split_rows(counts, [int((t == kind).sum()) for t in rows_types], name)
        if grid is None:
            continue
        patch_ends = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)]).tolist()
        for b, sl in enumerate(slices):
            if sl.start == sl.stop:
                continue
            per_row[b][patch_key] = pixels[patch_ends[sl.start]: patch_ends[sl.stop]]
            for key in row_keys:
                if key in processor_outputs:
                    per_row[b][key] = torch.as_tensor(processor_outputs[key])[sl]
    unknown = set(processor_outputs) - set(MULTIMODAL_KEYS)
    if unknown:
        raise ValueError(f"unknown multimodal inputs {sorted(unknown)}; known: {list(MULTIMODAL_KEYS)}")
    return pack_multimodal(model, rows_ids, per_row)
