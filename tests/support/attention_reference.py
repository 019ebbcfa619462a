"""Plain softmax attention over one segment, the reference the block and flash plans are tested against."""

from __future__ import annotations

import math

import torch


def plain_attention(q, k, v, positions, window, scale):
    """Softmax over keys ``j <= p`` (and ``p - j < window``) of one segment, GQA by repetition."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qnh,knh->nqk", q, k) * scale
    j = torch.arange(k.shape[0])
    allowed = (j[None, :] <= positions[:, None]) & ((positions[:, None] - j[None, :]) < (window or 10**9))
    return torch.einsum("nqk,knh->qnh", torch.softmax(scores.masked_fill(~allowed, -math.inf), -1), v)
