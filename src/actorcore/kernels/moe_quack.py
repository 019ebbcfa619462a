"""The experts' SwiGLU MLP as quack's Hopper GEMMs, with the token gather and the gated activation inside them.

Legend as in ``moe_permute``: ``T`` tokens, ``K`` experts per token, ``S = T * K`` sorted rows, ``D`` features,
``E`` experts, ``I`` the experts' intermediate width.

Why: between the grouped GEMMs of an MoE layer, the sorted path (``moe_permute`` and ``grouped_mm``) copies every
token's features to its ``K`` sorted rows and runs SwiGLU and its backward as separate passes over ``[S, 2I]``; on
the H200 these are most of the MoE actor step's elementwise time. quack (Tri Dao's CuTe-DSL kernels,
``quack-kernels``) loads the first GEMM's rows through the gather (``A_idx``), computes SwiGLU in its epilogue from
the fp32 accumulators (``gemm_gated``), and SwiGLU's backward in the epilogue of the down projection's input
gradient (``gemm_dgated``); the weight gradients are its variable-length-K GEMMs. What remains outside the GEMMs is
one gather of the inputs in backward (for the gate/up weight gradient) and the sum of each token's ``K`` input
gradients (``sum_rows_per_token``, the sorted path's own backward).

Math: ``rows[s] = down[e] @ (silu(g) * u)`` with ``[g; u] = gate_up[e] @ x[token_of_row[s]]`` for the rows ``s``
of expert ``e``; transformers' experts with a concatenated ``gate_up_proj`` (``[E, 2I, D]``), ``down_proj``
(``[E, D, I]``), SiLU gate, no bias. SwiGLU from the fp32 accumulators (eager rounds gate and up to bf16 first):
within bf16 rounding of the sorted path, closer to fp32. CUDA on Hopper or newer, bf16 / fp16 only.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

import torch

from actorcore.kernels.moe_permute import ExpertOrder, sum_rows_per_token

INSTALL_HINT = "pip install quack-kernels==0.6.4 'nvidia-cutlass-dsl[cu13]==4.6.2' ([cu12] on CUDA 12)"


def _dsl_requirement(quack_requires: list[str]) -> str | None:
    """The version specifier quack's metadata puts on nvidia-cutlass-dsl (``"==4.6.2"``), or None."""
    for requirement in quack_requires:
        match = re.match(r"nvidia-cutlass-dsl(?![-\w])(\[[^\]]*\])?\s*([^;]*)(;.*)?$", requirement.strip())
        if match and "extra" not in (match.group(3) or ""):
            return match.group(2).strip() or None
    return None


def quack_refusal() -> str | None:
    """Why quack's fused experts GEMMs cannot run here (None: they can).

    quack compiles its kernels with the CuTe DSL on first use and keys them by what its epilogues depend on inside
    the DSL, so a DSL release quack was not built against fails at the first GEMM (measured on the H200:
    quack-kernels 0.6.5, whose requirement is the range ``>=4.7``, raises TypeError with nvidia-cutlass-dsl 4.7.1
    and 4.8.1). Taken: a quack that pins the DSL exactly, with that DSL installed."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return "quack's fused GEMMs need a Hopper (sm90) or newer CUDA GPU"
    try:
        quack_version = importlib.metadata.version("quack-kernels")
        dsl = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return f"quack-kernels or nvidia-cutlass-dsl is not installed ({INSTALL_HINT})"
    pinned = _dsl_requirement(importlib.metadata.requires("quack-kernels") or [])
    if pinned is None or not pinned.startswith("==") or pinned[2:] != dsl:
        return (f"quack-kernels {quack_version} asks for nvidia-cutlass-dsl{pinned or ' (any)'} and "
                f"{dsl} is installed: only a quack that pins the DSL exactly, with that DSL, is taken ({INSTALL_HINT})")
    return None


def _quack() -> Any:
    from quack import gemm_interface

    return gemm_interface


class _GatedExperts(torch.autograd.Function):
    """``rows = down(swiglu(gate_up(x[token_of_row])))`` per expert, as quack's grouped (variable-length) GEMMs."""

    @staticmethod
    def forward(ctx, x_TD, gate_up_EOD, down_EDI, token_of_row, row_of_pair, cu_seqlens):
        q = _quack()
        with torch.amp.autocast("cuda", enabled=False):
            preact, act = q.gemm_gated(x_TD, gate_up_EOD.mT, activation="swiglu", cu_seqlens_m=cu_seqlens,
                                       A_idx=token_of_row, concat_layout=("B",), tuned=False)
            rows = q.gemm(act, down_EDI.mT, cu_seqlens_m=cu_seqlens, tuned=False)
        ctx.save_for_backward(x_TD, gate_up_EOD, down_EDI, preact, token_of_row, row_of_pair, cu_seqlens)
        return rows

    @staticmethod
    def backward(ctx, grad_rows_SD):
        x_TD, gate_up_EOD, down_EDI, preact, token_of_row, row_of_pair, cu_seqlens = ctx.saved_tensors
        q = _quack()
        with torch.amp.autocast("cuda", enabled=False):
            grad_rows = grad_rows_SD.contiguous()
            # the down projection's input gradient with SwiGLU's backward in its epilogue (and SwiGLU recomputed)
            grad_preact, act = q.gemm_dgated(grad_rows, down_EDI, preact, activation="swiglu",
                                             cu_seqlens_m=cu_seqlens, tuned=False)
            grad_down = q.gemm(grad_rows.T, act, cu_seqlens_k=cu_seqlens, tuned=False)
            x_rows = x_TD.index_select(0, token_of_row)
            grad_gate_up = q.gemm(grad_preact.T, x_rows, cu_seqlens_k=cu_seqlens, concat_layout=("out",),
                                  tuned=False)
            grad_x_rows = q.gemm(grad_preact, gate_up_EOD, cu_seqlens_m=cu_seqlens, concat_layout=("B",),
                                 tuned=False)
        return sum_rows_per_token(grad_x_rows, row_of_pair), grad_gate_up, grad_down, None, None, None


def gated_experts(x_TD: torch.Tensor, gate_up_EOD: torch.Tensor, down_EDI: torch.Tensor, order: ExpertOrder
                  ) -> torch.Tensor:
    """``[S, D]``: each sorted row of ``order`` through its expert's SwiGLU MLP (before the routing weights)."""
    if x_TD.dtype not in (torch.bfloat16, torch.float16) or gate_up_EOD.dtype != x_TD.dtype \
            or down_EDI.dtype != x_TD.dtype:
        raise ValueError(f"quack's fused experts GEMMs take bf16 / fp16 inputs and weights of one dtype, got "
                         f"{x_TD.dtype}, {gate_up_EOD.dtype}, {down_EDI.dtype}")
    cu_seqlens = torch.cat([order.offsets.new_zeros(1), order.offsets])
    return _GatedExperts.apply(x_TD.contiguous(), gate_up_EOD, down_EDI, order.token_of_row.int(),
                               order.row_of_pair, cu_seqlens)
