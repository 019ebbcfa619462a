"""MXFP4 (OCP microscaling FP4) weights in the layout of the gpt-oss checkpoints.

A weight ``[..., rows, cols]`` is stored as ``blocks`` uint8 ``[..., rows, cols / 32, 16]`` and ``scales`` uint8
``[..., rows, cols / 32]``: every run of 32 consecutive elements of a row shares one power-of-two scale
``2 ** (scales - 127)`` (E8M0), and each element is an FP4 E2M1 code (sign bit 3, magnitude codes 0..7 for
0, 0.5, 1, 1.5, 2, 3, 4, 6); two codes per byte, the even element in the low nibble.

``quantize_mxfp4`` picks the OCP scale (``floor(log2(amax)) - 2``, the exponent of the block's largest magnitude
less E2M1's largest exponent) and rounds to nearest, ties to even, saturating at 6. The choice is idempotent: a
weight that is already dequantised MXFP4 in this canonical form quantises back to the very same bytes, and any
MXFP4 weight re-quantises to the same values.
"""

from __future__ import annotations

import torch

BLOCK = 32
# The magnitudes of E2M1 codes 0..7, and the midpoints between neighbours (where rounding changes code).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_SCALE_BIAS = 127
_E2M1_MAX_EXPONENT = 2  # 6 = 1.5 * 2**2


# The tensor-name suffixes of a weight ``X`` stored as MXFP4: ``X_blocks`` (packed codes) and ``X_scales``.
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., rows, cols]`` in ``dtype`` from ``blocks`` ``[..., rows, cols / 32, 16]`` and ``scales``
    ``[..., rows, cols / 32]``. Exact in bf16 and fp32 (every MXFP4 value is a short power-of-two multiple)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: blocks "
                         f"must be scales' shape plus a last dimension of {BLOCK // 2} bytes")
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: even element first
    values = lut[codes].reshape(*scales.shape, BLOCK)
    values = torch.ldexp(values, (scales.to(torch.int32) - _SCALE_BIAS).unsqueeze(-1).to(torch.float32))
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``weight`` ``[..., rows, cols]`` (``cols`` a multiple of 32), blocks along the last
    dimension. Values beyond the block scale's range saturate at 6 times it; an all-zero block gets scale 2**-127.
    A non-finite value is refused (it has no MXFP4 code: its block would come back as other numbers)."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 quantises blocks of {BLOCK} along the last dimension; it has {weight.shape[-1]}")
    x = weight.detach().float().reshape(*weight.shape[:-1], weight.shape[-1] // BLOCK, BLOCK)
    amax = x.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("MXFP4 quantisation got a non-finite weight (inf or NaN); fix the weights before exporting "
                         "them as MXFP4, or export them in their own dtype")
    _, exponent = torch.frexp(amax)  # amax = m * 2**e with m in [0.5, 1): floor(log2(amax)) = e - 1
    shared = torch.where(amax > 0, exponent - 1 - _E2M1_MAX_EXPONENT, torch.full_like(exponent, -_SCALE_BIAS))
    shared = shared.clamp(-_SCALE_BIAS, _SCALE_BIAS)
    magnitude = torch.ldexp(x.abs(), (-shared).unsqueeze(-1).to(torch.float32))  # exact: a power-of-two scaling
    midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    code = torch.bucketize(magnitude, midpoints)  # ties land on the lower code ...
    tie_to_odd = (code % 2 == 1) & (code < len(_MIDPOINTS)) & (magnitude == midpoints[code.clamp(max=6)])
    code = code + tie_to_odd.long()  # ... and move up where that code is odd (ties to even)
    code = code | (torch.signbit(x).long() << 3)
    code = code.to(torch.uint8).reshape(*code.shape[:-1], BLOCK // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks.contiguous(), (shared + _SCALE_BIAS).to(torch.uint8)
