"""Vision features into a packed batch's text embeddings: the one merge both routes run (``hf/vlm/inputs.py`` for the
Hugging Face route, ``mcore/run/vlm_inputs.py`` for the Megatron route).

Legend: ``T`` tokens of the packed batch, ``D`` text hidden size, ``N`` visual tokens of one kind (image or video
placeholders).

What transformers' VLMs do in their forward, on one packed sequence: the vision tower's merged features replace the
placeholder tokens' embeddings in order (``masked_scatter``: packed order is sequence order is the order of the
processor's outputs), and Qwen3-VL's DeepStack features of each layer go to the visual tokens, images and videos
together in token order. How each route runs its tower and what it does with the result afterwards (the HF route's
sequence-parallel shard, the Megatron route's sequence-parallel scatter and per-layer additions) stays with the route.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class VisualFeatures:
    """Merged vision-tower outputs for the whole batch, in placeholder order."""

    image_ND: torch.Tensor | None = None
    video_ND: torch.Tensor | None = None
    # Qwen3-VL DeepStack: one ``[N_image, D]`` / ``[N_video, D]`` tensor per decoder layer it feeds.
    deepstack_image: list[torch.Tensor] = field(default_factory=list)
    deepstack_video: list[torch.Tensor] = field(default_factory=list)


def _cat(parts: Any) -> torch.Tensor:
    return torch.cat(list(parts), dim=0) if isinstance(parts, (list, tuple)) else parts


def tower_outputs(out: Any, who: str, deepstack: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(merged features [N, D], DeepStack features: one [N, D] per layer)`` of one vision-tower call: transformers'
    output with ``pooler_output`` (per item or concatenated) and, where the spec says the tower has them (``deepstack``),
    ``deepstack_features``; a tensor is the merged features itself. ``who``: the call, for the error."""
    merged = out if isinstance(out, torch.Tensor) else getattr(out, "pooler_output", None)
    if merged is None:
        raise ValueError(f"{who} returned {type(out).__name__} without pooler_output; this transformers version "
                         "returns vision features differently from what actorcore reads")
    layers: list[torch.Tensor] = []
    if deepstack:
        found = getattr(out, "deepstack_features", None)
        if found is None:
            raise ValueError(f"{who} returned no deepstack_features, which this architecture's spec says it has")
        layers = [_cat(layer) for layer in found]
    return _cat(merged), layers


def scatter_features(embeds_TD: torch.Tensor, mask_T: torch.Tensor, features_ND: torch.Tensor | None,
                     name: str) -> torch.Tensor:
    """``embeds_TD`` (``[T, ..., D]``) with the rows ``mask_T`` marks replaced by ``features_ND`` in order, in the
    embeddings' dtype; a count or a width that does not match is an error naming both."""
    tokens = int(mask_T.sum())
    have = 0 if features_ND is None else int(features_ND.shape[0])
    if tokens != have:
        raise ValueError(f"the batch has {tokens} {name} tokens but the vision tower produced {have} {name} "
                         f"features: {name} tokens and features do not match (pack the batch with actorcore.pack(..., "
                         "multimodal=..., model=...) from the processor's outputs)")
    if features_ND is None:
        return embeds_TD
    if features_ND.shape[-1] != embeds_TD.shape[-1]:
        raise ValueError(f"{name} features have width {features_ND.shape[-1]}, text embeddings {embeds_TD.shape[-1]}")
    mask = mask_T.reshape(-1, *(1,) * (embeds_TD.dim() - 1))
    return embeds_TD.masked_scatter(mask, features_ND.to(embeds_TD.dtype))


def deepstack_inputs(image_mask_T: torch.Tensor, video_mask_T: torch.Tensor,
                     features: VisualFeatures) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Visual-position mask ``[T]`` and per-layer features ``[N, D]`` in token order (images and videos joint)."""
    visual_T = image_mask_T | video_mask_T
    layers = max(len(features.deepstack_image), len(features.deepstack_video))
    joint = []
    for layer in range(layers):
        ref = (features.deepstack_image or features.deepstack_video)[layer]
        out_ND = ref.new_zeros(int(visual_T.sum()), ref.shape[-1])
        if features.deepstack_image:
            out_ND = out_ND.index_put((image_mask_T[visual_T].nonzero()[:, 0],), features.deepstack_image[layer])
        if features.deepstack_video:
            out_ND = out_ND.index_put((video_mask_T[visual_T].nonzero()[:, 0],), features.deepstack_video[layer])
        joint.append(out_ND)
    return visual_T, joint


def merge_visual_features(embeds_TD: torch.Tensor, image_mask_T: torch.Tensor, video_mask_T: torch.Tensor,
                          features: VisualFeatures
                          ) -> tuple[torch.Tensor, tuple[torch.Tensor, list[torch.Tensor]] | None]:
    """The embeddings with the image and then the video features at their placeholders, and the DeepStack inputs
    (``deepstack_inputs``) where the tower gave any (None otherwise)."""
    embeds_TD = scatter_features(embeds_TD, image_mask_T, features.image_ND, "image")
    embeds_TD = scatter_features(embeds_TD, video_mask_T, features.video_ND, "video")
    if not (features.deepstack_image or features.deepstack_video):
        return embeds_TD, None
    return embeds_TD, deepstack_inputs(image_mask_T, video_mask_T, features)
