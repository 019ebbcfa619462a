"""Input checks of the HF route's calls, run before any forward so bad input costs no work."""

from __future__ import annotations

from typing import Any

from actorcore.batch import PackedBatch


def check_batch(model: Any, batch: PackedBatch) -> PackedBatch:
    """The batch on the model's device, its token ids checked against the vocabulary."""
    if not isinstance(batch, PackedBatch):
        raise ValueError(f"batch must be an actorcore.PackedBatch (use ac.pack / ac.pack_padded), got "
                         f"{type(batch).__name__}")
    embeddings = model.get_input_embeddings()
    if embeddings.weight.is_meta:
        raise ValueError(f"{type(model).__name__}'s weights are on the meta device (never loaded): load them "
                         "(from_pretrained, or to_empty(device=...) and load_state_dict) before computing")
    vocab = getattr(embeddings, "num_embeddings", None)
    if vocab is not None and not batch.input_ids.is_cuda:
        low, high = int(batch.input_ids.min()), int(batch.input_ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"token ids span [{low}, {high}] but the model's vocabulary has {vocab} entries")
    device = embeddings.weight.device
    return batch if batch.device == device else batch.to(device)
