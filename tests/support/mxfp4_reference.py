"""A plain MXFP4 quantiser for tests, written from the OCP Microscaling spec and sharing no code with
``actorcore.kernels.mxfp4``: per block of 32 along the last dim, scale exponent ``floor(log2(amax)) - 2`` (E8M0,
bias 127; an all-zero block 2**-127), each element the nearest E2M1 value (0, .5, 1, 1.5, 2, 3, 4, 6), ties to the
even code, saturating at 6, the sign in bit 3 (negative zero keeps it); two codes per byte, even element low."""

from __future__ import annotations

import math

import torch

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _code(value: float) -> int:
    sign = 8 if math.copysign(1.0, value) < 0 else 0
    magnitude = min(abs(value), 6.0)
    distances = [abs(magnitude - g) for g in GRID]
    best = min(distances)
    candidates = [i for i, d in enumerate(distances) if d == best]
    even = [i for i in candidates if i % 2 == 0]
    return sign | (even or candidates)[0]


def reference_quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks uint8 [..., rows, cols/32, 16], scales uint8 [..., rows, cols/32])`` of ``weight [..., rows, cols]``."""
    flat = weight.detach().float().reshape(-1, 32)
    blocks, scales = [], []
    for block in flat.tolist():
        amax = max(abs(v) for v in block)
        exponent = max(-127, min(127, math.floor(math.log2(amax)) - 2)) if amax > 0 else -127
        codes = [_code(v / 2.0**exponent) for v in block]
        blocks.append([codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(16)])
        scales.append(exponent + 127)
    lead = tuple(weight.shape[:-1]) + (weight.shape[-1] // 32,)
    return (torch.tensor(blocks, dtype=torch.uint8).reshape(*lead, 16),
            torch.tensor(scales, dtype=torch.uint8).reshape(lead))
