"""Batch-invariant row-wise ops: every call runs on row tiles of one fixed size, so a row's result cannot
depend on how many rows the call has or on what the other rows are.

Legend: ``R`` rows (tokens, or tokens x heads), ``K`` input features, ``N`` output features.

Why: matmul libraries choose their kernel from the shape. cuBLAS picks tile sizes and split-K by M, and on the
CPU (MKL / oneDNN, measured here) a call with 1-3, 5-7 or 9-11 rows takes another kernel than a call with 4, 8
or >= 12, which rounds differently. So row r of ``x @ W.T`` changes with the number of rows M, i.e. with what a
sequence is packed with. Norm reductions pick their launch configuration from the number of rows too (torch's
CUDA reduction widens its blocks below 16 rows). Cutting the rows into tiles of exactly ``TILE_ROWS`` (the
last one overlapping the previous, or zero-padded when the call has fewer rows than a tile) gives every call the
same shapes; in a fixed-shape call a row's result does not depend on its position either (each output row is the
same sequence of operations on that row's inputs).

Only the forward is made invariant (that is what the log-probs and entropies are computed from); the backward
of ``tiled_linear`` is plain torch over all rows at once (parameter gradients are sums over the batch anyway).
"""

from __future__ import annotations

from typing import Callable

import torch

# Rows per tile of a linear, at least. Large enough that the GEMMs fill the GPU (for a 1024-row tile of a 1536-wide
# linear, cuBLAS picked a 192x128-tile kernel: about 72 tiles for the H200's 132 SMs), small enough that the last tile
# of a call recomputes few rows (<= 2047).
# Measured on the H200 (bench/batch_invariant.py --tile-rows, Qwen2.5-1.5B shape, 59.5K tokens): cost of the mode
# 1024 rows +18.6% forward / +21.0% forward+backward, 2048 rows +10.9% / +16.5%, 4096 rows +8.6% / +25.0% (the last
# tile then zero-padded; with it overlapping the previous one, 2048 rows: +11.1% / +15.6%).
TILE_ROWS = 2048
# Narrow linears (GQA key/value projections, a small model's attention and down projections) get taller tiles: the
# smallest power of two from TILE_ROWS up to MAX_TILE_ROWS whose call has TARGET_OUTPUT_TILES output tiles of
# 128 x 128 (about two waves on the H200's 132 SMs). A function of the layer's shape, never of the batch.
TARGET_OUTPUT_TILES = 256
MAX_TILE_ROWS = 8192
# Rows per tile of a norm: memory-bound and cheap, so larger tiles (fewer launches) cost little recomputation.
NORM_TILE_ROWS = 8192


def check_tile_rows(tile_rows: int) -> int:
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"tile_rows must be a positive int, got {tile_rows!r}")
    return tile_rows


def linear_tile_rows(out_features: int) -> int:
    """Rows per tile for a linear with ``out_features`` outputs (see ``TARGET_OUTPUT_TILES``)."""
    rows, column_tiles = TILE_ROWS, -(-out_features // 128)
    while rows < MAX_TILE_ROWS and (rows // 128) * column_tiles < TARGET_OUTPUT_TILES:
        rows *= 2
    return rows


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned, so every tile offers the kernel the same layout and alignment."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _last_tile(x_RK: torch.Tensor, start: int, tile_rows: int) -> tuple[torch.Tensor, int]:
    """The tile that computes rows ``start:`` (fewer than ``tile_rows``), and where they begin in it.

    With at least ``tile_rows`` rows: the full tile ending at the last row; its first rows were computed by the
    previous tile and come out the same (in a fixed-shape call a row's result does not depend on its position), so
    nothing is copied or zero-filled. With fewer rows in the whole call: the rows padded with zeros."""
    rows = x_RK.shape[0]
    if rows >= tile_rows:
        return x_RK[rows - tile_rows:], start - (rows - tile_rows)
    tile = x_RK.new_zeros(tile_rows, x_RK.shape[1])
    tile[:rows] = x_RK
    return tile, start


class _TiledLinear(torch.autograd.Function):
    """``x @ W.T + b`` computed tile by tile in the forward; the backward is plain torch over all rows."""

    @staticmethod
    def forward(ctx, x_RK, weight_NK, bias_N, tile_rows):
        rows = x_RK.shape[0]
        out_RN = x_RK.new_empty(rows, weight_NK.shape[0])
        weight_KN = weight_NK.t()
        for start in range(0, rows, tile_rows):
            end = min(start + tile_rows, rows)
            full = end - start == tile_rows
            tile, offset = (x_RK[start:end], 0) if full else _last_tile(x_RK, start, tile_rows)
            target = out_RN[start:end] if full else None
            if bias_N is None:
                result = torch.mm(tile, weight_KN, out=target)
            else:
                result = torch.addmm(bias_N, tile, weight_KN, out=target)
            if not full:
                out_RN[start:end] = result[offset: offset + end - start]
        ctx.save_for_backward(x_RK, weight_NK)
        ctx.has_bias = bias_N is not None
        return out_RN

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RN):
        x_RK, weight_NK = ctx.saved_tensors
        grad_x = grad_RN.mm(weight_NK) if ctx.needs_input_grad[0] else None
        grad_w = grad_RN.t().mm(x_RK) if ctx.needs_input_grad[1] else None
        grad_b = grad_RN.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 tile_rows: int | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` whose every row is computed in a call of exactly ``tile_rows`` rows
    (``None``: ``linear_tile_rows`` of the weight's output width).

    ``x`` is ``[..., K]``; inside a ``torch.autocast`` region the operands are cast as autocast casts a linear.
    """
    tile_rows = linear_tile_rows(weight.shape[0]) if tile_rows is None else check_tile_rows(tile_rows)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if x.dtype != weight.dtype:
        raise ValueError(f"tiled_linear: input dtype {x.dtype} differs from the weight's {weight.dtype}")
    lead = x.shape[:-1]
    x_RK = _aligned(x.reshape(-1, x.shape[-1]))
    if x_RK.shape[0] == 0:
        return torch.nn.functional.linear(x, weight, bias)
    out_RN = _TiledLinear.apply(x_RK, weight, bias, tile_rows)
    return out_RN.reshape(*lead, weight.shape[0])


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               tile_rows: int = NORM_TILE_ROWS) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` over the last dimension (a norm), run on ``[tile_rows, D]`` tiles.

    Plain autograd through ``fn`` on every tile (the last one overlapping the previous, or zero-padded: see
    ``_last_tile``; a norm maps zero rows to zeros).
    """
    check_tile_rows(tile_rows)
    lead, width = x.shape[:-1], x.shape[-1]
    x_RD = x.reshape(-1, width)
    rows = x_RD.shape[0]
    if rows == 0:
        return fn(x)
    outs = []
    for start in range(0, rows, tile_rows):
        end = min(start + tile_rows, rows)
        if end - start == tile_rows:
            outs.append(fn(x_RD[start:end]))
        else:
            tile, offset = _last_tile(x_RD, start, tile_rows)
            outs.append(fn(tile)[offset: offset + end - start])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*lead, out.shape[-1])
