"""How a weight stream groups its tensors into buckets: a pure function shared by the HF route's stream
(``export/``) and the Megatron route's (``mcore/convert/weight_stream.py``), which may not import each other."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

import torch

Key = TypeVar("Key", bound=Hashable)

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
Bucket = list[tuple[str, torch.Tensor]]  # one bucket of a weight stream: (HF name, full tensor) pairs


def plan_buckets(sizes: Sequence[tuple[Key, int]], bucket_bytes: int) -> list[list[Key]]:
    """Consecutive keys grouped so each group's bytes are <= ``bucket_bytes``; a tensor larger than that is alone."""
    buckets: list[list[Key]] = []
    used = 0
    for key, nbytes in sizes:
        if not buckets or used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(key)
        used += nbytes
    return buckets
