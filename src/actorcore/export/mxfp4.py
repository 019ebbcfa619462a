"""MXFP4 export: a weight stream with an architecture's fused-expert weights re-quantised to MXFP4, in the layout of
the gpt-oss releases (``X_blocks`` ``[E, out, in / 32, 16]`` and ``X_scales`` ``[E, out, in / 32]`` for a weight
``X`` ``[E, in, out]``; ``kernels/mxfp4.py``), and the ``quantization_config`` that tells loaders so.

Weights that came from an MXFP4 checkpoint come back as the same values (and, in canonical form, the same bytes);
weights trained since are rounded to MXFP4 (lossy). The default export stays bf16.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator

from actorcore.buckets import Bucket
from actorcore.kernels.mxfp4 import MXFP4_BLOCKS, MXFP4_SCALES, quantize_mxfp4

# The released gpt-oss configs' list: everything but the experts stays bf16.
GPT_OSS_MODULES_TO_NOT_CONVERT = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                  "lm_head")


def mxfp4_quantization_config(modules_to_not_convert: Iterable[str] = GPT_OSS_MODULES_TO_NOT_CONVERT) -> dict:
    """``config.json``'s ``quantization_config`` for an MXFP4 export (transformers' ``Mxfp4Config`` fields)."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": list(modules_to_not_convert)}


def quantize_stream_mxfp4(buckets: Iterable[Bucket], weight_suffixes: Iterable[str]) -> Iterator[Bucket]:
    """``buckets`` with each tensor named ``...<suffix>`` (``McoreSpec.mxfp4_weights``) replaced by its MXFP4
    ``_blocks`` and ``_scales``; every other tensor passes as it is."""
    suffixes = tuple(weight_suffixes)
    if not suffixes:  # checked at the call, before the stream starts
        raise ValueError("this architecture names no MXFP4 weights (McoreSpec.mxfp4_weights): export it unquantised")
    return _quantized(buckets, suffixes)


def _quantized(buckets: Iterable[Bucket], suffixes: tuple[str, ...]) -> Iterator[Bucket]:
    for bucket in buckets:
        out: Bucket = []
        for name, tensor in bucket:
            if name.endswith(suffixes):
                blocks, scales = quantize_mxfp4(tensor.transpose(-1, -2))
                out += [(name + MXFP4_BLOCKS, blocks), (name + MXFP4_SCALES, scales)]
            else:
                out.append((name, tensor))
        yield out


def with_mxfp4_config(hf_config: Any) -> Any:
    """A copy of ``hf_config`` with the MXFP4 ``quantization_config`` (what ``save_pretrained`` writes to
    config.json)."""
    config = copy.deepcopy(hf_config)
    config.quantization_config = mxfp4_quantization_config()
    return config


def without_quantization_config(hf_config: Any) -> Any:
    """``hf_config``, or a copy without ``quantization_config`` (its own and its ``text_config``'s) when it has one:
    what an unquantized export writes. The source's config may claim quantized tensors the export does not hold: an
    MXFP4 checkpoint's, or the compressed-tensors entry that transformers keeps in ``text_config`` after dequantizing
    on load, which loaders trust (vLLM's Kimi-K2.5 config takes ``text_config.quantization_config``)."""
    def holders(config: Any) -> list[Any]:
        text = getattr(config, "text_config", None)
        return [c for c in (config, text) if c is not None and getattr(c, "quantization_config", None) is not None]

    if not holders(hf_config):
        return hf_config
    config = copy.deepcopy(hf_config)
    for holder in holders(config):
        del holder.quantization_config
    return config
