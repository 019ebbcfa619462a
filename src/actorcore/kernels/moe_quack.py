"""The experts' SwiGLU MLP as quack's Hopper GEMMs, with the token gather and the gated activation inside them.

Legend as in ``moe_permute``: ``T`` tokens, ``K`` experts per token, ``S = T * K`` sorted rows, ``D`` features,
``E`` experts, ``I`` the experts' intermediate width.

Why: between the grouped GEMMs of an MoE layer, the sorted path (``moe_permute`` and ``grouped_mm``) copies every
token's features to its ``K`` sorted rows and runs SwiGLU and its backward as separate passes over ``[S, 2I]``; on
the H200 these are most of the MoE actor step's elementwise time. quack (Tri Dao's CuTe-DSL kernels,
``quack-kernels``) loads the first GEMM's rows through the gather (``A_idx``), computes SwiGLU in its epilogue from
the fp32 accumulators (``gemm_gated``), and SwiGLU's backward in the epilogue of the down projection's input
gradient (``gemm_dgated``), which also gathers each row's token gradient in its loads, scales it by the row's
routing weight and reduces the routing weights' gradient in its epilogue (the combine's backward, without the
``[S, D]`` row gradients nor the rows kept for it); the weight gradients are its variable-length-K GEMMs, loading
their token rows through the gather too. What remains outside the GEMMs is the combine's forward (each token's
``K`` rows weighted and summed) and the sum of each token's ``K`` input gradients (``sum_rows_per_token``).

Math: ``out[t] = sum_j weights[t, j] * rows[row_of_pair[t, j]]``, ``rows[s] = down[e] @ (silu(g) * u)`` with
``[g; u] = gate_up[e] @ x[token_of_row[s]]`` for the rows ``s`` of expert ``e``; transformers' experts with a
concatenated ``gate_up_proj`` (``[E, 2I, D]``), ``down_proj`` (``[E, D, I]``), SiLU gate, no bias. SwiGLU,
the routing weights and their gradient from the fp32 accumulators (eager rounds to bf16 between them): within bf16
rounding of the sorted path, closer to fp32. CUDA on Hopper or newer, bf16 / fp16 only.
"""

from __future__ import annotations

import torch

from actorcore.kernels.moe_permute import ExpertOrder, sum_rows_per_token, weighted_rows_per_token
from actorcore.kernels.quack_runtime import gemm_interface

class _GatedExperts(torch.autograd.Function):
    """``out = combine(down(swiglu(gate_up(x[token_of_row]))), weights)`` per expert, as quack's grouped
    (variable-length) GEMMs; the combine's backward inside the down projection's input-gradient GEMM."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, gate_up_EOD, down_EDI, token_of_row, pair_of_row, row_of_pair, cu_seqlens):
        q = gemm_interface()
        with torch.amp.autocast("cuda", enabled=False):
            preact, act = q.gemm_gated(x_TD, gate_up_EOD.mT, activation="swiglu", cu_seqlens_m=cu_seqlens,
                                       A_idx=token_of_row, concat_layout=("B",), tuned=False)
            rows = q.gemm(act, down_EDI.mT, cu_seqlens_m=cu_seqlens, tuned=False)
            out = weighted_rows_per_token(rows, weights_TK, row_of_pair, x_TD.dtype)
        ctx.save_for_backward(x_TD, weights_TK, gate_up_EOD, down_EDI, preact, token_of_row, pair_of_row,
                              row_of_pair, cu_seqlens)
        return out

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, weights_TK, gate_up_EOD, down_EDI, preact, token_of_row, pair_of_row, row_of_pair, cu_seqlens = \
            ctx.saved_tensors
        q = gemm_interface()
        with torch.amp.autocast("cuda", enabled=False):
            grad_out = grad_out_TD.contiguous()
            weight_of_row = weights_TK.reshape(-1).index_select(0, pair_of_row).float()
            # The down projection's input gradient for each row's token (gathered in the loads), times the row's
            # routing weight, with SwiGLU's backward in the epilogue; it also gives the weighted activation
            # (recomputed) and each row's routing-weight gradient <grad_out[token], rows> (from fp32 accumulators).
            grad_preact, weighted_act, grad_weight_of_row = q.gemm_dgated(
                grad_out, down_EDI, preact, activation="swiglu", colvec_scale=weight_of_row, colvec_reduce=True,
                cu_seqlens_m=cu_seqlens, A_idx=token_of_row, tuned=False)
            grad_down = torch.empty_like(down_EDI)
            q.gemm(grad_out.T, weighted_act, out=grad_down, cu_seqlens_k=cu_seqlens, A_idx=token_of_row,
                   tuned=False)
            # per expert x[token_of_row]^T @ grad_preact, the rows gathered in the loads, written transposed
            grad_gate_up = torch.empty_like(gate_up_EOD)
            q.gemm(x_TD.T, grad_preact, out=grad_gate_up.mT, cu_seqlens_k=cu_seqlens, A_idx=token_of_row,
                   concat_layout=("out",), tuned=False)
            grad_x_rows = q.gemm(grad_preact, gate_up_EOD, cu_seqlens_m=cu_seqlens, concat_layout=("B",),
                                 tuned=False)
        grad_weights = grad_weight_of_row.index_select(0, row_of_pair.reshape(-1)).view_as(weights_TK)
        return (sum_rows_per_token(grad_x_rows, row_of_pair), grad_weights.to(weights_TK.dtype), grad_gate_up,
                grad_down, None, None, None, None)


def gated_experts(x_TD: torch.Tensor, weights_TK: torch.Tensor, gate_up_EOD: torch.Tensor, down_EDI: torch.Tensor,
                  order: ExpertOrder) -> torch.Tensor:
    """``[T, D]``: each token through its experts' SwiGLU MLPs (the sorted rows of ``order``), weighted by its
    routing weights and summed (float32, rounded once)."""
    if x_TD.dtype not in (torch.bfloat16, torch.float16) or gate_up_EOD.dtype != x_TD.dtype \
            or down_EDI.dtype != x_TD.dtype:
        raise ValueError(f"quack's fused experts GEMMs take bf16 / fp16 inputs and weights of one dtype, got "
                         f"{x_TD.dtype}, {gate_up_EOD.dtype}, {down_EDI.dtype}")
    cu_seqlens = torch.cat([order.offsets.new_zeros(1), order.offsets])
    return _GatedExperts.apply(x_TD.contiguous(), weights_TK, gate_up_EOD, down_EDI, order.token_of_row.int(),
                               order.pair_of_row, order.row_of_pair, cu_seqlens)
