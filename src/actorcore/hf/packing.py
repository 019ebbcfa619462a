"""``actorcore.pack`` / ``actorcore.pack_padded``: the data layer's packing, plus VLM inputs.

Text batches need nothing but token ids (``actorcore.batch``). A VLM batch also needs the model: its own
rope-index function gives the M-RoPE position ids, and its vision spec says how pixels, grids and
placeholders must agree (``actorcore.hf.vlm.packing``). This module is the one
public door to both, so the data layer never imports a route.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from actorcore import batch as text_batch
from actorcore.batch import PackedBatch
from actorcore.hf.vlm import packing as vlm_packing


def pack(sequences: Sequence[torch.Tensor], multimodal: Sequence[dict | None] | None = None,
         model: Any = None) -> PackedBatch:
    """Concatenate 1-D id tensors into one packed batch with per-sequence position ids.

    VLMs: pass each sequence's processor outputs (``multimodal``, ``None`` for text) and the ``model``.
    """
    if model is not None:
        return vlm_packing.pack_multimodal(
            model, sequences, [None] * len(sequences) if multimodal is None else multimodal)
    if multimodal is not None:
        raise ValueError("multimodal inputs need model=... (its rope-index function computes the position ids, its "
                         "vision spec checks the pixels against the placeholders)")
    return text_batch.pack(sequences)


def pack_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, model: Any = None,
                **multimodal: Any) -> PackedBatch:
    """Pack a left- or right-padded ``[B, S]`` batch, dropping the padding.

    VLMs: pass the ``model`` and the processor's other outputs (``pixel_values``, ``image_grid_thw``,
    ``mm_token_type_ids``, ...) as keywords.
    """
    if model is not None:
        return vlm_packing.pack_multimodal_padded(model, input_ids, attention_mask, **multimodal)
    if multimodal:
        raise ValueError(f"multimodal inputs {sorted(multimodal)} need model=... (its rope-index function "
                         "computes the position ids)")
    return text_batch.pack_padded(input_ids, attention_mask)
