"""Ulysses sequence parallelism: trade the sequence shard for a head shard around attention.

Legend: ``T`` all tokens, ``L`` this rank's tokens (``T / sp``), ``N`` query heads, ``K`` kv heads,
``n`` / ``k`` this rank's heads (``N / sp``, ``K / sp``), ``H`` head dim, ``S`` the sp group size.

Before attention each rank holds ``[L, N, H]`` (its tokens, every head); attention needs every token of a
sequence, so an all-to-all turns it into ``[T, n, H]`` (every token, its heads); after attention the inverse
all-to-all returns ``[L, N, H]``. The reshapes are pure functions; the exchange is
``collectives.all_to_all`` (differentiable, its own adjoint).
"""

from __future__ import annotations

from typing import Any

import torch

from actorcore.parallel.collectives import all_to_all


def valid_sp_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """SP sizes the heads can take: ``N % sp == 0`` and kv heads split (``K % sp == 0``) or replicate
    (``sp % K == 0``) into whole heads per rank."""
    return [s for s in range(1, num_heads + 1)
            if num_heads % s == 0 and (num_kv_heads % s == 0 or s % num_kv_heads == 0)]


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Refuse an SP size the attention heads cannot be split over, naming the sizes that work."""
    if sp_size not in valid_sp_sizes(num_heads, num_kv_heads):
        raise ValueError(
            f"Ulysses sequence parallelism cannot split {num_heads} query heads and {num_kv_heads} key/value heads "
            f"over sp_size={sp_size}: query heads must divide evenly and kv heads must either divide evenly or be "
            f"replicated into whole heads. Valid sp sizes for this model: {valid_sp_sizes(num_heads, num_kv_heads)}"
        )


def replicate_kv_heads(x_LKH: torch.Tensor, sp_size: int) -> torch.Tensor:
    """Repeat each kv head ``sp / K`` times when ``K < sp`` so every rank gets one whole kv head.

    Rank ``r`` then holds original kv head ``r // (sp / K)``, which is exactly the kv head its query heads
    ``[r N / sp, (r + 1) N / sp)`` use. Differentiable: the copies' gradients are summed back.
    """
    num_kv = x_LKH.shape[1]
    if num_kv >= sp_size:
        return x_LKH
    return x_LKH.repeat_interleave(sp_size // num_kv, dim=1)


def heads_of_rank(x_NX: torch.Tensor, sp_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block of heads along dim 0 (``[N / sp, ...]``), as ``sequence_to_head_sharded`` of
    ``replicate_kv_heads`` gives it for activations: each head repeated ``sp / N`` times first when ``N < sp``.
    For per-head parameters (a convolution's channels) that go with exchanged activations."""
    if x_NX.shape[0] < sp_size:
        x_NX = x_NX.repeat_interleave(sp_size // x_NX.shape[0], dim=0)
    n = x_NX.shape[0] // sp_size
    return x_NX[rank * n:(rank + 1) * n]


def split_heads_into_blocks(x_LNH: torch.Tensor, sp_size: int) -> torch.Tensor:
    """``[L, N, H]`` -> ``[S, L, n, H]``: block ``s`` holds head group ``s`` (to be sent to rank ``s``)."""
    L, N, H = x_LNH.shape
    return x_LNH.reshape(L, sp_size, N // sp_size, H).permute(1, 0, 2, 3)


def merge_token_blocks(x_SLnH: torch.Tensor) -> torch.Tensor:
    """``[S, L, n, H]`` (block ``s``: rank ``s``'s tokens) -> ``[T, n, H]`` in token order."""
    S, L, n, H = x_SLnH.shape
    return x_SLnH.reshape(S * L, n, H)


def split_tokens_into_blocks(x_TnH: torch.Tensor, sp_size: int) -> torch.Tensor:
    """``[T, n, H]`` -> ``[S, L, n, H]``: block ``s`` holds rank ``s``'s tokens (to be sent back to it)."""
    T, n, H = x_TnH.shape
    return x_TnH.reshape(sp_size, T // sp_size, n, H)


def merge_head_blocks(x_SLnH: torch.Tensor) -> torch.Tensor:
    """``[S, L, n, H]`` (block ``s``: head group ``s``) -> ``[L, N, H]`` in head order."""
    S, L, n, H = x_SLnH.shape
    return x_SLnH.permute(1, 0, 2, 3).reshape(L, S * n, H)


def sequence_to_head_sharded(x_LNH: torch.Tensor, group: Any, sp_size: int) -> torch.Tensor:
    """This rank's tokens with all heads ``[L, N, H]`` -> all tokens with this rank's heads ``[T, n, H]``."""
    if x_LNH.shape[1] % sp_size:
        raise ValueError(f"{x_LNH.shape[1]} heads do not split over sp_size={sp_size}")
    return merge_token_blocks(all_to_all(split_heads_into_blocks(x_LNH, sp_size), group))


def head_to_sequence_sharded(x_TnH: torch.Tensor, group: Any, sp_size: int) -> torch.Tensor:
    """All tokens with this rank's heads ``[T, n, H]`` -> this rank's tokens with all heads ``[L, N, H]``."""
    if x_TnH.shape[0] % sp_size:
        raise ValueError(f"{x_TnH.shape[0]} tokens do not split over sp_size={sp_size}")
    return merge_head_blocks(all_to_all(split_tokens_into_blocks(x_TnH, sp_size), group))
