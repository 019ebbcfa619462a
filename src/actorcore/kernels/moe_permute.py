"""Moving tokens to their experts and back, with gathers only in both directions (mixture-of-experts layers).

Legend: ``T`` tokens, ``K`` experts chosen per token (top-k), ``S = T * K`` (token, slot) pairs, ``D`` features,
``E`` experts, ``O`` output features.

An MoE layer runs each token through its ``K`` chosen experts. To batch them per expert (grouped GEMMs), the ``S``
(token, slot) pairs are sorted by expert once (``sort_by_expert``), each token's features copied to its rows in
that order (``permute``), and each token's ``K`` output rows summed back with its routing weights (``combine``).
Written with plain indexing, as transformers' grouped experts forward is, the backward of the first copy is a
scatter-add into the tokens with duplicate indices (atomics in the model's dtype, nondeterministic) and the second
copy adds another scatter; compiled by Inductor they are its slowest copy kernels. Here each direction is a gather:
``permute``'s backward gathers, for each token, the gradients of its ``K`` rows (their positions in the sorted
order) and sums them; ``combine``'s backward gathers, for each row, its token's gradient. Sums over the ``K`` slots
accumulate in float32 (float64 for float64 inputs) and round once, as a ``[T, K, D] -> [T, D]`` sum in float32
would. No atomics, no scatter of features: deterministic, bitwise from run to run. The only scatter is the inverse
of the sort order (``S`` integers, no duplicates).

``expert_bias`` gives each sorted row the bias of its expert; its backward sums each expert's rows by a one-hot
matmul (float32 accumulation in the GEMM) rather than the scatter-add that indexing's backward would be.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ExpertOrder(NamedTuple):
    """The (token, slot) pairs sorted by expert (stable: within an expert, in token order)."""

    token_of_row: torch.Tensor  # [S] the token whose features each sorted row holds
    pair_of_row: torch.Tensor  # [S] the flat (token, slot) index t * K + j of each sorted row
    row_of_pair: torch.Tensor  # [T, K] the sorted row of each (token, slot)
    expert_of_row: torch.Tensor  # [S] the expert of each sorted row (non-decreasing)
    offsets: torch.Tensor  # [E] int32: the end row of each expert's group (``grouped_mm``'s ``offs``)


def sort_by_expert(top_k_index_TK: torch.Tensor, num_experts: int) -> ExpertOrder:
    """Sort the (token, slot) pairs of ``top_k_index`` (``[T, K]`` expert ids in ``[0, num_experts)``) by expert."""
    num_tokens, top_k = top_k_index_TK.shape
    expert_of_row, pair_of_row = torch.sort(top_k_index_TK.reshape(-1), stable=True)
    rows = torch.arange(pair_of_row.numel(), device=pair_of_row.device, dtype=pair_of_row.dtype)
    row_of_pair = torch.empty_like(pair_of_row).scatter_(0, pair_of_row, rows).view(num_tokens, top_k)
    experts = torch.arange(num_experts, device=expert_of_row.device, dtype=expert_of_row.dtype)
    offsets = torch.searchsorted(expert_of_row, experts, right=True, out_int32=True)
    return ExpertOrder(pair_of_row // top_k, pair_of_row, row_of_pair, expert_of_row, offsets)


def _accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    result = torch.float32
    for dtype in dtypes:
        result = torch.promote_types(result, dtype)
    return result


class _Permute(torch.autograd.Function):
    """``rows[s] = x[token_of_row[s]]``; backward ``grad_x[t] = sum_j grad_rows[row_of_pair[t, j]]``."""

    @staticmethod
    def forward(ctx, x_TD, token_of_row, row_of_pair):
        ctx.save_for_backward(row_of_pair)
        return x_TD.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad_rows_SD):
        (row_of_pair,) = ctx.saved_tensors
        return sum_rows_per_token(grad_rows_SD, row_of_pair), None, None


def sum_rows_per_token(rows_SD: torch.Tensor, row_of_pair_TK: torch.Tensor) -> torch.Tensor:
    """``[T, D]``: each token's ``K`` sorted rows summed (gathers, float32 accumulation, rounded once)."""
    acc = _accumulation_dtype(rows_SD.dtype)
    out = rows_SD.index_select(0, row_of_pair_TK[:, 0]).to(acc)
    for slot in range(1, row_of_pair_TK.shape[1]):
        out = out + rows_SD.index_select(0, row_of_pair_TK[:, slot]).to(acc)
    return out.to(rows_SD.dtype)


def weighted_rows_per_token(rows_SD: torch.Tensor, weights_TK: torch.Tensor, row_of_pair_TK: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, D]``: each token's ``K`` sorted rows times its routing weights, summed (float32, rounded once)."""
    acc = _accumulation_dtype(rows_SD.dtype, weights_TK.dtype)
    weights = weights_TK.to(acc)
    out = rows_SD.index_select(0, row_of_pair_TK[:, 0]).to(acc) * weights[:, 0:1]
    for slot in range(1, row_of_pair_TK.shape[1]):
        out = out + rows_SD.index_select(0, row_of_pair_TK[:, slot]).to(acc) * weights[:, slot:slot + 1]
    return out.to(out_dtype)


class _Combine(torch.autograd.Function):
    """``out[t] = sum_j weights[t, j] * rows[row_of_pair[t, j]]`` in float32, rounded once to ``out_dtype``.

    Backward: ``grad_rows[s] = weights[pair] * grad_out[token]`` for the row's (token, slot) ``pair``, and
    ``grad_weights[t, j] = <grad_out[t], rows[row_of_pair[t, j]]>`` in float32."""

    @staticmethod
    def forward(ctx, rows_SD, weights_TK, token_of_row, pair_of_row, row_of_pair, out_dtype):
        ctx.save_for_backward(rows_SD, weights_TK, token_of_row, pair_of_row, row_of_pair)
        return weighted_rows_per_token(rows_SD, weights_TK, row_of_pair, out_dtype)

    @staticmethod
    def backward(ctx, grad_out_TD):
        rows_SD, weights_TK, token_of_row, pair_of_row, row_of_pair = ctx.saved_tensors
        acc = _accumulation_dtype(rows_SD.dtype, weights_TK.dtype, grad_out_TD.dtype)
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            row_weight = weights_TK.reshape(-1).index_select(0, pair_of_row).to(acc)
            grad_rows = (grad_out_TD.index_select(0, token_of_row).to(acc) * row_weight[:, None]).to(rows_SD.dtype)
        if ctx.needs_input_grad[1]:
            grad = grad_out_TD.to(acc)
            grad_weights = torch.stack(
                [(grad * rows_SD.index_select(0, row_of_pair[:, slot]).to(acc)).sum(-1)
                 for slot in range(row_of_pair.shape[1])], dim=1).to(weights_TK.dtype)
        return grad_rows, grad_weights, None, None, None, None


class _ExpertBias(torch.autograd.Function):
    """``rows[s] = bias[expert_of_row[s]]``; backward sums each expert's rows (one-hot matmul, no scatter-add)."""

    @staticmethod
    def forward(ctx, bias_EO, expert_of_row):
        ctx.save_for_backward(expert_of_row)
        ctx.num_experts = bias_EO.shape[0]
        return bias_EO.index_select(0, expert_of_row)

    @staticmethod
    def backward(ctx, grad_rows_SO):
        (expert_of_row,) = ctx.saved_tensors
        experts = torch.arange(ctx.num_experts, device=expert_of_row.device, dtype=expert_of_row.dtype)
        one_hot_SE = (expert_of_row[:, None] == experts).to(grad_rows_SO.dtype)
        return one_hot_SE.t() @ grad_rows_SO, None


def permute(x_TD: torch.Tensor, order: ExpertOrder) -> torch.Tensor:
    """``[S, D]``: each sorted row holds its token's features."""
    return _Permute.apply(x_TD, order.token_of_row, order.row_of_pair)


def combine(rows_SD: torch.Tensor, weights_TK: torch.Tensor, order: ExpertOrder, out_dtype: torch.dtype
            ) -> torch.Tensor:
    """``[T, D]``: each token's rows weighted by its routing weights and summed (float32, rounded once)."""
    return _Combine.apply(rows_SD, weights_TK, order.token_of_row, order.pair_of_row, order.row_of_pair, out_dtype)


def expert_bias(bias_EO: torch.Tensor, order: ExpertOrder) -> torch.Tensor:
    """``[S, O]``: the bias of each sorted row's expert."""
    return bias_of_rows(bias_EO, order.expert_of_row)


def bias_of_rows(bias_EO: torch.Tensor, expert_of_row_S: torch.Tensor) -> torch.Tensor:
    """``[S, O]``: ``bias[expert_of_row[s]]`` for each row (rows in any order); its backward sums each expert's rows
    by a one-hot matmul."""
    return _ExpertBias.apply(bias_EO, expert_of_row_S)
