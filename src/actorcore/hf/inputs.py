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
    check_weights_not_compressed(model)
    vocab = getattr(embeddings, "num_embeddings", None)
    if vocab is not None and not batch.input_ids.is_cuda:
        low, high = int(batch.input_ids.min()), int(batch.input_ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"token ids span [{low}, {high}] but the model's vocabulary has {vocab} entries")
    device = embeddings.weight.device
    return batch if batch.device == device else batch.to(device)


def check_weights_not_compressed(model: Any) -> None:
    """Refuse a model that transformers loaded from a compressed-tensors checkpoint without dequantizing it (Kimi-K2.5's
    INT4 release, say): its quantized modules hold packed integers that take no gradient, and modules the checkpoint
    stores unquantized but the quantization config targets (Kimi-K2.5's vision tower and projector) are left at
    their random initialisation, which transformers only reports in its load report."""
    config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    method = getattr(config, "quant_method", None)
    if str(getattr(method, "value", method)) != "compressed-tensors" or getattr(config, "dequantize", False) \
            or not getattr(config, "is_quantization_compressed", False):
        return
    raise ValueError(f"{type(model).__name__} holds compressed-tensors quantized weights (loaded from a compressed "
                     "checkpoint without dequantizing): load it with from_pretrained(..., quantization_config="
                     "CompressedTensorsConfig(dequantize=True)), which gives unquantized weights")
