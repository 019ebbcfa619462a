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

``gated_expert_rows`` is the same pair of GEMMs for rows a token dispatcher already sorted by expert (Megatron's,
on the Megatron route): no gather in the loads, and the routing probability scales each row's activation before the
down projection, where Megatron's experts apply it (one pass over ``[S, I]``); its gradient comes from the same
epilogue reduction, and the rows' gradients go back to the dispatcher as they are.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from actorcore.kernels.grouped_gemm import stack_experts
from actorcore.kernels.moe_permute import ExpertOrder, sum_rows_per_token, weighted_rows_per_token
from actorcore.kernels.quack import runtime
from actorcore.kernels.recomputed_input import RecomputedInput, recompute


def _gated_forward(q, x, gate_up_EOD, cu_seqlens, A_idx):
    """``(preact, act)`` of each sorted row's expert: ``[g; u] = gate_up[e] @ x[row]`` (rows gathered by ``A_idx``
    in the loads; ``None``: the rows of ``x`` in order), SwiGLU in the epilogue from the fp32 accumulators."""
    return q.gemm_gated(x, gate_up_EOD.mT, activation="swiglu", cu_seqlens_m=cu_seqlens, A_idx=A_idx,
                        concat_layout=("B",), tuned=False)


def _gated_backward(q, grad_out, x, gate_up_EOD, down_EDI, preact, weight_of_row, cu_seqlens, A_idx):
    """The experts' gradients from each sorted row's output gradient ``grad_out[A_idx[row]]`` (``A_idx`` None:
    ``grad_out``'s rows in order), the rows scaled by ``weight_of_row`` (fp32) before the down projection.

    The down projection's input gradient, times the row's weight, with SwiGLU's backward in its epilogue; it also
    gives the weighted activation (recomputed) and each row's weight gradient <grad_out row, down @ act> (from
    fp32 accumulators). Returns (input gradient per sorted row, weight gradient per row, gate_up's, down's)."""
    grad_preact, weighted_act, grad_weight_of_row = q.gemm_dgated(
        grad_out, down_EDI, preact, activation="swiglu", colvec_scale=weight_of_row, colvec_reduce=True,
        cu_seqlens_m=cu_seqlens, A_idx=A_idx, tuned=False)
    grad_down = torch.empty_like(down_EDI)
    q.gemm(grad_out.T, weighted_act, out=grad_down, cu_seqlens_k=cu_seqlens, A_idx=A_idx, tuned=False)
    # per expert x[A_idx]^T @ grad_preact, the rows gathered in the loads, written transposed
    grad_gate_up = torch.empty_like(gate_up_EOD)
    q.gemm(x.T, grad_preact, out=grad_gate_up.mT, cu_seqlens_k=cu_seqlens, A_idx=A_idx, concat_layout=("out",),
           tuned=False)
    grad_x_rows = q.gemm(grad_preact, gate_up_EOD, cu_seqlens_m=cu_seqlens, concat_layout=("B",), tuned=False)
    return grad_x_rows, grad_weight_of_row, grad_gate_up, grad_down


class RowPasses(NamedTuple):
    """The two passes over ``[S, D]`` rows outside the GEMMs: the combine's forward and the sum of each token's ``K``
    input gradients. Eager, each is a gather, an fp32 cast, a multiply and an add per slot; inside a compiled graph
    Inductor fuses them, and a caller outside one may pass them compiled (one kernel each)."""

    combine: Callable = weighted_rows_per_token
    sum_per_token: Callable = sum_rows_per_token


def _experts_forward(x_TD, weights_TK, gate_up_EOD, down_EDI, token_of_row, row_of_pair, cu_seqlens,
                     passes=RowPasses()):
    """``(preact, out)``: the gated GEMM over the gathered rows, the down projection, the combine (fp32)."""
    q = runtime.gemm_interface()
    with torch.amp.autocast("cuda", enabled=False):
        preact, act = _gated_forward(q, x_TD, gate_up_EOD, cu_seqlens, token_of_row)
        rows = q.gemm(act, down_EDI.mT, cu_seqlens_m=cu_seqlens, tuned=False)
        return preact, passes.combine(rows, weights_TK, row_of_pair, x_TD.dtype)


def _experts_backward(grad_out_TD, x_TD, weights_TK, gate_up_EOD, down_EDI, preact, token_of_row, pair_of_row,
                      row_of_pair, cu_seqlens, passes=RowPasses()):
    """``(grad x, grad weights, grad gate_up, grad down)`` of ``_experts_forward``."""
    q = runtime.gemm_interface()
    with torch.amp.autocast("cuda", enabled=False):
        weight_of_row = weights_TK.reshape(-1).index_select(0, pair_of_row).float()
        grad_x_rows, grad_weight_of_row, grad_gate_up, grad_down = _gated_backward(
            q, grad_out_TD.contiguous(), x_TD, gate_up_EOD, down_EDI, preact, weight_of_row, cu_seqlens,
            token_of_row)
    grad_weights = grad_weight_of_row.index_select(0, row_of_pair.reshape(-1)).view_as(weights_TK)
    return passes.sum_per_token(grad_x_rows, row_of_pair), grad_weights.to(weights_TK.dtype), grad_gate_up, grad_down


class _GatedExperts(torch.autograd.Function):
    """``out = combine(down(swiglu(gate_up(x[token_of_row]))), weights)`` per expert, as quack's grouped
    (variable-length) GEMMs; the combine's backward inside the down projection's input-gradient GEMM."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, gate_up_EOD, down_EDI, token_of_row, pair_of_row, row_of_pair, cu_seqlens):
        preact, out = _experts_forward(x_TD, weights_TK, gate_up_EOD, down_EDI, token_of_row, row_of_pair,
                                       cu_seqlens)
        ctx.save_for_backward(x_TD, weights_TK, gate_up_EOD, down_EDI, preact, token_of_row, pair_of_row,
                              row_of_pair, cu_seqlens)
        return out

    @staticmethod
    def backward(ctx, grad_out_TD):
        grad_x, grad_weights, grad_gate_up, grad_down = _experts_backward(grad_out_TD, *ctx.saved_tensors)
        return grad_x, grad_weights, grad_gate_up, grad_down, None, None, None, None


class _GatedExpertsOfModules(torch.autograd.Function):
    """``_GatedExperts`` with each expert's weights a tensor of its own (Megatron's per-expert parameters): stacked
    in forward and again in backward (``stack_experts``: in place where consecutive), their gradients back to each."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, token_of_row, pair_of_row, row_of_pair, cu_seqlens, passes, x_from,
                per_expert, *weights):
        gate_up_EOD, down_EDI = _pair(weights, per_expert)
        preact, out = _experts_forward(x_TD, weights_TK, gate_up_EOD, down_EDI, token_of_row, row_of_pair,
                                       cu_seqlens, passes)
        ctx.save_for_backward(x_TD if x_from is None else x_from.source, weights_TK, preact, token_of_row,
                              pair_of_row, row_of_pair, cu_seqlens, *weights)
        ctx.per_expert, ctx.passes, ctx.x_shape = per_expert, passes, x_TD.shape
        ctx.x_fn = None if x_from is None else x_from.fn
        return out

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, weights_TK, preact, token_of_row, pair_of_row, row_of_pair, cu_seqlens, *weights = ctx.saved_tensors
        if ctx.x_fn is not None:  # kept as the norm's input: the norm again (kernels.recomputed_input)
            x_TD = recompute(ctx.x_fn, x_TD).reshape(ctx.x_shape)
        gate_up_EOD, down_EDI = _pair(weights, ctx.per_expert)
        grad_x, grad_weights, grad_gate_up, grad_down = _experts_backward(
            grad_out_TD, x_TD, weights_TK, gate_up_EOD, down_EDI, preact, token_of_row, pair_of_row, row_of_pair,
            cu_seqlens, ctx.passes)
        return (grad_x, grad_weights, None, None, None, None, None, None, None, *grad_gate_up.unbind(0),
                *grad_down.unbind(0))


def _check_quack_operands(x: torch.Tensor, *weights: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16) or any(w.dtype != x.dtype for w in weights):
        raise ValueError(f"quack's fused experts GEMMs take bf16 / fp16 inputs and weights of one dtype, got "
                         f"{x.dtype}, {', '.join(str(w.dtype) for w in weights)}")


def gated_experts(x_TD: torch.Tensor, weights_TK: torch.Tensor, gate_up: torch.Tensor | Sequence[torch.Tensor],
                  down: torch.Tensor | Sequence[torch.Tensor], order: ExpertOrder,
                  passes: RowPasses | None = None, x_from: RecomputedInput | None = None) -> torch.Tensor:
    """``[T, D]``: each token through its experts' SwiGLU MLPs (the sorted rows of ``order``), weighted by its
    routing weights and summed (float32, rounded once). ``gate_up`` / ``down``: ``[E, 2I, D]`` / ``[E, D, I]``, or
    each expert's ``[2I, D]`` / ``[D, I]`` (their gradients go back to each; then ``passes`` may be compiled, and
    ``x_from`` may name ``x``'s source and norm: backward keeps the source and recomputes ``x``)."""
    stacked = isinstance(gate_up, torch.Tensor)
    _check_quack_operands(x_TD, *((gate_up, down) if stacked else (*gate_up, *down)))
    cu_seqlens = torch.cat([order.offsets.new_zeros(1), order.offsets])
    index = (order.token_of_row.int(), order.pair_of_row, order.row_of_pair, cu_seqlens)
    if stacked:
        if passes is not None or x_from is not None:
            raise ValueError("gated_experts: row passes and x_from are taken with per-expert weights only (stacked "
                             "weights are the HF route's, whose compiled decoder layers hold the passes)")
        return _GatedExperts.apply(x_TD.contiguous(), weights_TK, gate_up, down, *index)
    if x_from is not None and not x_TD.is_contiguous():
        raise ValueError("gated_experts(x_from=...) takes a contiguous x: the recomputed x must be its layout")
    return _GatedExpertsOfModules.apply(x_TD.contiguous(), weights_TK, *index, passes or RowPasses(), x_from,
                                        len(gate_up), *gate_up, *down)


class _GatedRows(torch.autograd.Function):
    """``rows_out = down(swiglu(gate_up(rows)) * probs)`` per expert over rows already sorted by expert (a token
    dispatcher moved them): the same GEMMs without the gather and the combine. ``weights``: ``(gate_up, down)``
    stacked (``per_expert == 0``), or each expert's gate_up then each expert's down (``per_expert`` of each),
    stacked in forward and again in backward (``grouped_gemm.stack_experts``: in place where consecutive)."""

    @staticmethod
    def forward(ctx, rows_SD, probs_S, cu_seqlens, per_expert, *weights):
        gate_up_EOD, down_EDI = _pair(weights, per_expert)
        q = runtime.gemm_interface()
        with torch.amp.autocast("cuda", enabled=False):
            preact, act = _gated_forward(q, rows_SD, gate_up_EOD, cu_seqlens, None)
            scaled = (act * probs_S[:, None]).to(act.dtype)  # the probabilities before the down projection
            out = q.gemm(scaled, down_EDI.mT, cu_seqlens_m=cu_seqlens, tuned=False)
        ctx.save_for_backward(rows_SD, probs_S, preact, cu_seqlens, *weights)
        ctx.per_expert = per_expert
        return out

    @staticmethod
    def backward(ctx, grad_out_SD):
        rows_SD, probs_S, preact, cu_seqlens, *weights = ctx.saved_tensors
        gate_up_EOD, down_EDI = _pair(weights, ctx.per_expert)
        q = runtime.gemm_interface()
        with torch.amp.autocast("cuda", enabled=False):
            grad_rows, grad_probs, grad_gate_up, grad_down = _gated_backward(
                q, grad_out_SD.contiguous(), rows_SD, gate_up_EOD, down_EDI, preact, probs_S.float(), cu_seqlens,
                None)
        grads = (grad_gate_up, grad_down) if not ctx.per_expert else (*grad_gate_up.unbind(0), *grad_down.unbind(0))
        return grad_rows, grad_probs.to(probs_S.dtype), None, None, *grads


def _pair(weights: tuple, per_expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not per_expert:
        return weights[0], weights[1]
    return stack_experts(weights[:per_expert]), stack_experts(weights[per_expert:])


def gated_expert_rows(rows_SD: torch.Tensor, probs_S: torch.Tensor, gate_up: torch.Tensor | Sequence[torch.Tensor],
                      down: torch.Tensor | Sequence[torch.Tensor], offsets_E: torch.Tensor) -> torch.Tensor:
    """``[S, D]``: rows sorted by expert (``offsets_E``: each expert's end row) through their expert's SwiGLU MLP,
    the activation scaled by the row's routing probability before the down projection (rounded once to the
    rows' dtype), as Megatron's experts weight their rows. ``gate_up`` / ``down``: ``[E, 2I, D]`` / ``[E, D, I]``,
    or each expert's ``[2I, D]`` / ``[D, I]`` (their gradients go back to each)."""
    stacked = isinstance(gate_up, torch.Tensor)
    weights = (gate_up, down) if stacked else (*gate_up, *down)
    _check_quack_operands(rows_SD, *weights)
    cu_seqlens = torch.cat([offsets_E.new_zeros(1), offsets_E]).to(torch.int32)
    return _GatedRows.apply(rows_SD.contiguous(), probs_S, cu_seqlens, 0 if stacked else len(gate_up), *weights)
