"""The loss-fused head's forward statistics in the epilogue of quack's warp-specialised Hopper GEMM.

quack's SM90 GEMM (CuTe DSL) runs a producer warp that issues the TMA loads beside two consumer warp groups
that take turns (ping-pong): one group's epilogue runs while the other's MMAs do, which the head's Triton kernel
cannot (one 8-warp program per SM, its epilogue stalling the tensor cores). The epilogue here computes from the
fp32 accumulators of each 128 x 128 logits tile what the Triton kernel computes: the tile's row maximum m (a
prepass over the accumulators), z - m stored in fp16 (z = logits / T), and per row and tile sum exp(z - m),
sum (z - m) exp(z - m) and the label's logit. The rest of the loss-fused chunk is unchanged: the in-place pass to
grad_logits, grad_hidden on cuBLAS, grad_weight accumulated by quack's GEMM (faster than cuBLAS's addmm there).

Measured on the H200 (docs/bench_head.md): each stage alone is 4-5% faster than what the Triton path runs, but
the whole head is within -1.3% to +1.6% of the Triton path across the RL shapes, as the board holds its power
limit either way. So it lives here, as a benchmark variant of the Triton engine (``QuackStatsEngine``, the
``quack_stats_loss`` cells of ``bench/logprob.py``; ``bench/head_quack.py`` times its stages and checks them per token
against fp32 logits), not in the product.

It runs where it was measured: an sm90 GPU, bf16 hidden and weight, a vocabulary that is a multiple of 128 (one
maximum per tile), 16-byte aligned rows, no softcap, not the batch-invariant mode; elsewhere it refuses with the
reason. quack is imported on first use.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from actorcore.kernels.logprob._common import merge_partial_stats
from actorcore.kernels.logprob.triton_engine import TritonEngine
from actorcore.kernels.quack.runtime import gemm_interface, quack_refusal
from actorcore.kernels.trace import add

TILE_N = 128  # vocabulary columns per tile: one stored maximum each
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


def quack_stats_refusal(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, softcap: float | None,
                        batch_invariant: bool) -> str | None:
    """Why the quack statistics GEMM cannot serve this call (None: it can)."""
    if softcap is not None:
        return "a logit softcap is not in its epilogue"
    if batch_invariant:
        return "the batch-invariant mode keeps the Triton kernel"
    if hidden_CD.dtype != torch.bfloat16 or weight_VD.dtype != torch.bfloat16:
        return f"it takes bf16 hidden states and weights, got {hidden_CD.dtype} and {weight_VD.dtype}"
    vocab, dim = weight_VD.shape
    if vocab % TILE_N:
        return f"the vocabulary ({vocab}) is not a multiple of {TILE_N}"
    if dim % 8 or weight_VD.stride(1) != 1 or hidden_CD.stride(1) != 1 or weight_VD.stride(0) % 8 \
            or hidden_CD.stride(0) % 8:
        return "its TMA loads need contiguous rows of 16-byte multiples"
    if not hidden_CD.is_cuda or torch.cuda.get_device_capability(hidden_CD.device) != (9, 0):
        return "it is built and measured for sm90 (Hopper) only"
    return quack_refusal()


@functools.cache
def _stats_epilogue():
    """The epilogue, built once per process on first use (quack mints and caches its kernel per config)."""
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.math import pexp2
    from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect
    from quack.epilogue.scaled_exp import MaxLog2

    tile_max = MaxLog2("max_log2", round_to_int=False)  # k = log2(e) * max(acc) per (row, tile)
    label = ColVecLoad("target")

    def prepass(acc):
        return {"max_log2": acc}

    @gemm_epilogue(
        ops={"max_log2": tile_max},
        prepass=prepass,
        prepass_outs=("max_log2",),
        reduces={"sum_exp": ColVecReduce("sum_exp"), "sum_dexp": ColVecReduce("sum_dexp", scaled=True)},
        outs={"target_logit": ColVecSelect("target_logit", idx_op=label)},
        extra_ops=(tile_max.out("max_log2_out"), label),
    )
    def logprob_stats_epi(acc, max_log2, inv_t):
        shifted2 = (acc * LOG2E - max_log2) * inv_t  # (z - m) / ln 2, <= 0
        e = pexp2(shifted2)
        shifted = shifted2 * LN2
        return {"D": shifted, "sum_exp": e, "sum_dexp": (shifted, e), "target_logit": acc}

    return logprob_stats_epi


def stats_and_shifted_logits(h_CD: torch.Tensor, weight_VD: torch.Tensor, labels_C: torch.Tensor,
                             z_CV: torch.Tensor, shift_CN: torch.Tensor, temperature: float, entropy: bool):
    """One GEMM: z - m into ``z_CV`` (fp16), m per (token, 128-column tile) into ``shift_CN``; returns the
    [S, C] partial statistics (S = tiles) for ``merge_partial_stats`` (the entropy's None without ``entropy``)."""
    n_c, vocab = h_CD.shape[0], weight_VD.shape[0]
    inv_t = 1.0 / temperature
    dev = h_CD.device
    k_CN = torch.empty(n_c, vocab // TILE_N, dtype=torch.float32, device=dev)
    s_CN, a_CN = torch.empty_like(k_CN), torch.empty_like(k_CN)
    zy_C = torch.zeros(n_c, dtype=torch.float32, device=dev)
    _stats_epilogue().gemm(
        h_CD, weight_VD, z_CV,
        epi_args=dict(max_log2=TILE_N, max_log2_out=k_CN, sum_exp=s_CN, sum_dexp=a_CN, target=labels_C,
                      target_logit=zy_C, inv_t=inv_t),
        tile_M=128, tile_N=TILE_N, cluster_M=2, cluster_N=1, pingpong=True,
    )
    return tile_partials(k_CN, s_CN, a_CN, zy_C, inv_t, shift_CN, entropy)


def tile_partials(k_CN, s_CN, a_CN, zy_C, inv_t, shift_CN, entropy=True):
    """The epilogue's outputs -> the [S, C] partials of ``merge_partial_stats`` (natural units; no entropy partial
    without ``entropy``, as the Triton kernel gives none), and each tile's maximum of z = logits / T into
    ``shift_CN`` for the grad_logits pass."""
    torch.mul(k_CN, inv_t * LN2, out=shift_CN)
    return shift_CN.t(), s_CN.t(), a_CN.t() if entropy else None, (zy_C * inv_t)[None]


def add_grad_weight(grad_w_VD: torch.Tensor, g_CV: torch.Tensor, h_CD: torch.Tensor) -> None:
    """grad_weight += G^T h on quack's GEMM (fp32 accumulators, rounded once into the weight's dtype)."""
    gemm_interface().gemm_add_inplace(g_CV.t(), h_CD, grad_w_VD, tuned=False)


@dataclass(frozen=True)
class QuackStatsEngine(TritonEngine):
    """The Triton engine with the loss-fused forward's statistics and the grad_weight accumulation on quack's GEMMs
    (trace key ``logprob:quack_loss_stats``: chunks whose statistics came from quack)."""

    def _stats_and_shifted_logits(self, h_CD, weight_VD, labels_C, z_CV, shift_CN, temperature, softcap, entropy,
                                  trace=None):
        why = quack_stats_refusal(h_CD, weight_VD, softcap, self.batch_invariant)
        if why is not None:
            raise ValueError(f"the quack statistics GEMM cannot run here: {why}; use TritonEngine")
        add(trace, "logprob:quack_loss_stats")
        return merge_partial_stats(*stats_and_shifted_logits(h_CD, weight_VD, labels_C, z_CV, shift_CN, temperature,
                                                             entropy))

    def _shift_cols(self) -> int:
        return TILE_N

    def _accumulate_grad_weight(self, grad_w_VD, g_CV, h_CD) -> None:
        add_grad_weight(grad_w_VD, g_CV, h_CD)
