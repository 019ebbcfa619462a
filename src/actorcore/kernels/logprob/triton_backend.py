"""Triton backend (CUDA, bf16/fp16 inputs): fused lm-head matmul + online logsumexp/entropy.

Shape suffixes: T tokens, D hidden, V vocab (this rank's rows under tensor parallelism), C tokens
of one backward chunk, S vocabulary splits of the forward grid. Imported only when the Triton backend
is chosen (it imports triton at module top).

Forward: one launch over a grid of (token tile x vocabulary split). Each program streams its split of
the vocabulary in [BLOCK_T, BLOCK_V] logit tiles (tl.dot, fp32 accumulators: logits are never rounded
to 16 bits) and keeps per-token online statistics (running max m, sum exp s, sum exp*(z-m) a, the
label's logit). The [S, T] partials are merged by a few torch ops. Memory: O(T * S) floats.

Backward: per chunk of C tokens, a GEMM-shaped kernel recomputes the logits tile by tile and writes
grad_logits (fp32 math, stored in the input dtype, as Liger does) into a bounded [C, V] workspace;
cuBLAS then computes grad_hidden = G @ W and accumulates grad_weight += G^T @ h (fp32 accumulation
inside each matmul, rounded to the weight dtype once per chunk). No atomics: results are identical
run to run. Workspace: C * V * 2 bytes (``default_backward_rows``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


logger = logging.getLogger(__name__)

# Bytes of the bf16/fp16 grad_logits workspace of one backward chunk.
BACKWARD_WORKSPACE_BYTES = 512 << 20
# Vocabulary tiles that one forward program streams (sets the number of vocabulary splits S).
FWD_TILES_PER_SPLIT = 16

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps 0 * (z - m) at 0 for masked columns


@dataclass
class LaunchCounter:
    """How many forward / backward Triton launches ran; tests use it to prove this path was taken."""

    forward: int = 0
    backward: int = 0
    tma: int = 0  # launches of the TMA variants (a subset of the two above)


LAUNCHES = LaunchCounter()


@dataclass(frozen=True)
class Config:
    block_t: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int
    group: int = 8


# Chosen by ``bench/logprob.py --sweep`` on the H200 (N=16384, H=4096, V=151936; docs/benchmarks.md):
# forward 626 TFLOP/s with TMA loads; the grad_logits kernel is faster with plain pointer loads
# (586 vs 558 TFLOP/s with TMA).
FWD_CONFIG = Config(block_t=128, block_v=256, block_k=64, num_warps=8, num_stages=3, group=16)
BWD_CONFIG = Config(block_t=128, block_v=256, block_k=64, num_warps=8, num_stages=3)


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits at +-inf, absolute error ~1e-7 near 0.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _online_update(acc, offs_v, labels, V, m, s, a, zy, inv_temp, softcap, inv_softcap,
                   HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr):
    """Fold one [BLOCK_T, BLOCK_V] tile of raw fp32 logits into the per-token running statistics."""
    if HAS_SOFTCAP:
        acc = _tanh(acc * inv_softcap) * softcap
    col_ok = offs_v < V
    z = tl.where(col_ok[None, :], acc * inv_temp, _NEG)
    hit = (offs_v[None, :] == labels[:, None]) & col_ok[None, :]
    zy += tl.sum(tl.where(hit, z, 0.0), axis=1)
    m_new = tl.maximum(m, tl.max(z, axis=1))
    alpha = tl.exp(m - m_new)
    zc = z - m_new[:, None]
    e = tl.exp(zc)
    if ENTROPY:
        a = alpha * (a + (m - m_new) * s) + tl.sum(e * zc, axis=1)
    s = s * alpha + tl.sum(e, axis=1)
    return m_new, s, a, zy


@triton.jit
def _grad_tile(acc, offs_v, rows_t, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp, softcap, inv_softcap,
               HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr):
    """grad of (g_lp * logprob + g_ent * entropy) w.r.t. one tile of raw fp32 logits."""
    if HAS_SOFTCAP:
        t = _tanh(acc * inv_softcap)
        z = t * softcap * inv_temp
    else:
        z = acc * inv_temp
    lse = tl.load(lse_ptr + rows_t)
    logp = z - lse[:, None]
    p = tl.exp(logp)
    if HAS_GENT:
        gent = tl.load(gent_ptr + rows_t)
        ent = tl.load(ent_ptr + rows_t)
        coef = gent[:, None] * (logp + ent[:, None])
        if HAS_GLP:
            glp = tl.load(glp_ptr + rows_t)
            coef += glp[:, None]
        g = -p * coef
    else:
        glp = tl.load(glp_ptr + rows_t)
        g = -p * glp[:, None]
    if HAS_GLP:
        labels = tl.load(lab_ptr + rows_t).to(tl.int64)
        g += tl.where(offs_v[None, :] == labels[:, None], glp[:, None], 0.0)
    g = g * inv_temp
    if HAS_SOFTCAP:
        g = g * (1.0 - t * t)
    return g


@triton.jit
def _tile_ids(pid, num_t_tiles, num_other, GROUP: tl.constexpr):
    """Grouped launch order: GROUP token tiles x all vocabulary tiles/splits run together (L2 reuse)."""
    per_group = GROUP * num_other
    first_t = (pid // per_group) * GROUP
    group_size = tl.minimum(num_t_tiles - first_t, GROUP)
    return first_t + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _fwd_stats_kernel(
    h_ptr, w_ptr, lab_ptr, m_ptr, s_ptr, a_ptr, zy_ptr,
    T, V, D,
    stride_ht, stride_hd, stride_wv, stride_wd,
    num_splits,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, EVEN_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    pid_t, pid_s = _tile_ids(tl.program_id(0), tl.cdiv(T, BLOCK_T), num_splits, GROUP)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rows_t = (offs_t % T).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    labels = tl.load(lab_ptr + rows_t).to(tl.int64)
    v_lo = pid_s * (TILES_PER_SPLIT * BLOCK_V)
    m = tl.full((BLOCK_T,), _NEG, tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    a = tl.zeros((BLOCK_T,), tl.float32)
    zy = tl.zeros((BLOCK_T,), tl.float32)
    h_base = h_ptr + rows_t[:, None] * stride_ht
    # constant trip count (the last split may run a few fully masked tiles; 1% at V=151936)
    for i in range(0, TILES_PER_SPLIT):
        offs_v = v_lo + i * BLOCK_V + tl.arange(0, BLOCK_V)
        w_base = w_ptr + (offs_v % V).to(tl.int64)[None, :] * stride_wv
        acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for k in range(0, D, BLOCK_K):
            kk = k + offs_k
            if EVEN_K:
                x = tl.load(h_base + kk[None, :] * stride_hd)
                y = tl.load(w_base + kk[:, None] * stride_wd)
            else:
                x = tl.load(h_base + kk[None, :] * stride_hd, mask=kk[None, :] < D, other=0.0)
                y = tl.load(w_base + kk[:, None] * stride_wd, mask=kk[:, None] < D, other=0.0)
            acc = tl.dot(x, y, acc)
        m, s, a, zy = _online_update(acc, offs_v, labels, V, m, s, a, zy, inv_temp, softcap, inv_softcap,
                                     HAS_SOFTCAP, ENTROPY)
    out = pid_s * T + offs_t
    ok = offs_t < T
    tl.store(m_ptr + out, m, mask=ok)
    tl.store(s_ptr + out, s, mask=ok)
    tl.store(zy_ptr + out, zy, mask=ok)
    if ENTROPY:
        tl.store(a_ptr + out, a, mask=ok)


@triton.jit
def _fwd_stats_kernel_tma(
    h_desc, w_desc, lab_ptr, m_ptr, s_ptr, a_ptr, zy_ptr,
    T, V, D,
    num_splits,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """As ``_fwd_stats_kernel`` with TMA tile loads (zero fill out of bounds, no address arithmetic)."""
    pid_t, pid_s = _tile_ids(tl.program_id(0), tl.cdiv(T, BLOCK_T), num_splits, GROUP)
    off_t = pid_t * BLOCK_T
    offs_t = off_t + tl.arange(0, BLOCK_T)
    rows_t = (offs_t % T).to(tl.int64)
    labels = tl.load(lab_ptr + rows_t).to(tl.int64)
    v_lo = pid_s * (TILES_PER_SPLIT * BLOCK_V)
    m = tl.full((BLOCK_T,), _NEG, tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    a = tl.zeros((BLOCK_T,), tl.float32)
    zy = tl.zeros((BLOCK_T,), tl.float32)
    for i in range(0, TILES_PER_SPLIT):
        off_v = v_lo + i * BLOCK_V
        offs_v = off_v + tl.arange(0, BLOCK_V)
        acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for k in range(0, D, BLOCK_K):
            x = h_desc.load([off_t, k])
            y = w_desc.load([off_v, k])
            acc = tl.dot(x, y.T, acc)
        m, s, a, zy = _online_update(acc, offs_v, labels, V, m, s, a, zy, inv_temp, softcap, inv_softcap,
                                     HAS_SOFTCAP, ENTROPY)
    out = pid_s * T + offs_t
    ok = offs_t < T
    tl.store(m_ptr + out, m, mask=ok)
    tl.store(s_ptr + out, s, mask=ok)
    tl.store(zy_ptr + out, zy, mask=ok)
    if ENTROPY:
        tl.store(a_ptr + out, a, mask=ok)


@triton.jit
def _bwd_grad_logits_kernel(
    h_ptr, w_ptr, g_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
    C, V, D,
    stride_ht, stride_hd, stride_wv, stride_wd, stride_gc,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    pid_t, pid_v = _tile_ids(tl.program_id(0), tl.cdiv(C, BLOCK_T), tl.cdiv(V, BLOCK_V), GROUP)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    rows_t = (offs_t % C).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    h_base = h_ptr + rows_t[:, None] * stride_ht
    w_base = w_ptr + (offs_v % V).to(tl.int64)[None, :] * stride_wv
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    for k in range(0, D, BLOCK_K):
        kk = k + offs_k
        if EVEN_K:
            x = tl.load(h_base + kk[None, :] * stride_hd)
            y = tl.load(w_base + kk[:, None] * stride_wd)
        else:
            x = tl.load(h_base + kk[None, :] * stride_hd, mask=kk[None, :] < D, other=0.0)
            y = tl.load(w_base + kk[:, None] * stride_wd, mask=kk[:, None] < D, other=0.0)
        acc = tl.dot(x, y, acc)
    g = _grad_tile(acc, offs_v, rows_t, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp, softcap,
                   inv_softcap, HAS_SOFTCAP, HAS_GLP, HAS_GENT)
    ok = (offs_t[:, None] < C) & (offs_v[None, :] < V)
    g_ptrs = g_ptr + offs_t.to(tl.int64)[:, None] * stride_gc + offs_v[None, :]
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_grad_logits_kernel_tma(
    h_desc, w_desc, g_desc, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
    C, V, D,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """As ``_bwd_grad_logits_kernel`` with TMA loads and a TMA store (clipped at the tensor's bounds)."""
    pid_t, pid_v = _tile_ids(tl.program_id(0), tl.cdiv(C, BLOCK_T), tl.cdiv(V, BLOCK_V), GROUP)
    off_t = pid_t * BLOCK_T
    off_v = pid_v * BLOCK_V
    offs_t = off_t + tl.arange(0, BLOCK_T)
    offs_v = off_v + tl.arange(0, BLOCK_V)
    rows_t = (offs_t % C).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    for k in range(0, D, BLOCK_K):
        x = h_desc.load([off_t, k])
        y = w_desc.load([off_v, k])
        acc = tl.dot(x, y.T, acc)
    g = _grad_tile(acc, offs_v, rows_t, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp, softcap,
                   inv_softcap, HAS_SOFTCAP, HAS_GLP, HAS_GENT)
    g_desc.store([off_t, off_v], g.to(g_desc.dtype))


@triton.jit
def _rows_stats_kernel(
    l_ptr, lab_ptr, m_ptr, s_ptr, a_ptr, zy_ptr,
    V, stride_l,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    """Online statistics of one row of precomputed fp32 logits (the cuBLAS-recompute mode)."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(lab_ptr + row).to(tl.int64)
    base = l_ptr + row * stride_l
    m = tl.full((BLOCK,), _NEG, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    a = tl.zeros((BLOCK,), tl.float32)
    zy = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(base + offs, mask=ok, other=0.0)
        if HAS_SOFTCAP:
            x = _tanh(x * inv_softcap) * softcap
        z = tl.where(ok, x * inv_temp, _NEG)
        zy += tl.where((offs == label) & ok, z, 0.0)
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        zc = z - m_new
        e = tl.exp(zc)
        if ENTROPY:
            a = alpha * (a + (m - m_new) * s) + e * zc
        s = s * alpha + e
        m = m_new
    # merge the BLOCK lanes
    m_row = tl.max(m, axis=0)
    scale = tl.exp(m - m_row)
    s_row = tl.sum(s * scale, axis=0)
    tl.store(m_ptr + row, m_row)
    tl.store(s_ptr + row, s_row)
    tl.store(zy_ptr + row, tl.sum(zy, axis=0))
    if ENTROPY:
        tl.store(a_ptr + row, tl.sum(scale * (a + (m - m_row) * s), axis=0))


@triton.jit
def _rows_grad_kernel(
    l_ptr, g_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
    V, stride_l, stride_g,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_logits of one [1, BLOCK] piece from precomputed fp32 logits (the cuBLAS-recompute mode)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(l_ptr + row * stride_l + offs, mask=ok, other=0.0)
    if HAS_SOFTCAP:
        t = _tanh(x * inv_softcap)
        z = t * softcap * inv_temp
    else:
        z = x * inv_temp
    logp = z - tl.load(lse_ptr + row)
    p = tl.exp(logp)
    if HAS_GLP:
        glp = tl.load(glp_ptr + row)
    else:
        glp = 0.0
    if HAS_GENT:
        g = -p * (tl.load(gent_ptr + row) * (logp + tl.load(ent_ptr + row)) + glp)
    else:
        g = -p * glp
    if HAS_GLP:
        label = tl.load(lab_ptr + row).to(tl.int64)
        g += tl.where(offs == label, glp, 0.0)
    g = g * inv_temp
    if HAS_SOFTCAP:
        g = g * (1.0 - t * t)
    tl.store(g_ptr + row * stride_g + offs, g.to(g_ptr.dtype.element_ty), mask=ok)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b with fp32 accumulation and an fp32 result (cuBLAS writes its accumulator directly)."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:  # the CPU interpreter (TRITON_INTERPRET=1) and fp32 inputs
        torch.mm(a.float(), b.float(), out=out)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned base and row strides."""
    for t in tensors:
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def _desc(t: torch.Tensor, block: list[int], shape: list[int] | None = None):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(shape or t.shape), list(t.stride()), block)


def default_backward_rows(vocab: int, elem_bytes: int = 2, budget: int = BACKWARD_WORKSPACE_BYTES) -> int:
    """Tokens per backward chunk so the [C, V] grad_logits workspace stays within ``budget`` bytes."""
    rows = max(1, budget // (elem_bytes * vocab))
    return rows - rows % 128 if rows >= 256 else rows


def _merge_splits(m_ST, s_ST, a_ST, zy_ST):
    """Merge the forward's per-split statistics over the split axis (same algebra as the TP merge)."""
    if m_ST.shape[0] == 1:
        return m_ST[0], s_ST[0], (a_ST[0] if a_ST is not None else None), zy_ST[0]
    m_T = m_ST.amax(dim=0)
    scale_ST = torch.exp(m_ST - m_T)
    s_T = (s_ST * scale_ST).sum(dim=0)
    a_T = None
    if a_ST is not None:
        a_T = (scale_ST * (a_ST + (m_ST - m_T) * s_ST)).sum(dim=0)
    return m_T, s_T, a_T, zy_ST.sum(dim=0)


class TritonEngine:
    """Engine for ``LinearLogprobEntropyFunction`` running the kernels above.

    ``fwd_mode`` / ``bwd_mode``: "fused" computes logits inside the Triton kernel (tl.dot, fp32
    accumulators); "cublas" computes a chunk of fp32 logits with ``torch.mm(out_dtype=float32)`` and
    runs a memory-bound Triton kernel over it (one extra fp32 [C, V] buffer; measured no faster, kept
    as a cross-check). ``tma`` / ``bwd_tma``: TMA tile loads in the forward / backward kernel when the
    layout allows (unit last stride, 16-byte aligned rows), else plain pointer loads.
    """

    name = "triton"

    def __init__(
        self,
        fwd: Config = FWD_CONFIG,
        bwd: Config = BWD_CONFIG,
        fwd_mode: str = "fused",
        bwd_mode: str = "fused",
        rows_block: int = 4096,
        tma: bool = True,
        bwd_tma: bool = False,
    ):
        if fwd_mode not in ("fused", "cublas") or bwd_mode not in ("fused", "cublas"):
            raise ValueError(f"modes must be 'fused' or 'cublas', got {fwd_mode!r}, {bwd_mode!r}")
        self.fwd = fwd
        self.bwd = bwd
        self.fwd_mode = fwd_mode
        self.bwd_mode = bwd_mode
        self.rows_block = rows_block
        self.tma = tma
        self.bwd_tma = bwd_tma

    # ------------------------------------------------------------------ forward
    def forward_stats(self, hidden_TD, weight_VD, labels_T, *, temperature, softcap, entropy, chunk_size):
        labels_T = labels_T.contiguous()
        if self.fwd_mode == "cublas":
            return self._forward_cublas(hidden_TD, weight_VD, labels_T, temperature, softcap, entropy, chunk_size)
        n_tok, dim = hidden_TD.shape
        vocab = weight_VD.shape[0]
        cfg = self.fwd
        v_tiles = triton.cdiv(vocab, cfg.block_v)
        num_splits = triton.cdiv(v_tiles, FWD_TILES_PER_SPLIT)
        tiles_per_split = triton.cdiv(v_tiles, num_splits)
        dev = hidden_TD.device
        m_ST = torch.empty(num_splits, n_tok, dtype=torch.float32, device=dev)
        s_ST = torch.empty_like(m_ST)
        zy_ST = torch.empty_like(m_ST)
        a_ST = torch.empty_like(m_ST) if entropy else None
        grid = (triton.cdiv(n_tok, cfg.block_t) * num_splits,)
        common = dict(
            HAS_SOFTCAP=softcap is not None, ENTROPY=entropy, TILES_PER_SPLIT=tiles_per_split,
            BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        scalars = (1.0 / temperature, softcap or 1.0, 1.0 / (softcap or 1.0))
        outs = (m_ST, s_ST, a_ST if entropy else m_ST, zy_ST)
        if self.tma and _tma_ok(hidden_TD, weight_VD):
            LAUNCHES.tma += 1
            _fwd_stats_kernel_tma[grid](
                _desc(hidden_TD, [cfg.block_t, cfg.block_k]), _desc(weight_VD, [cfg.block_v, cfg.block_k]),
                labels_T, *outs, n_tok, vocab, dim, num_splits, *scalars, **common,
            )
        else:
            _fwd_stats_kernel[grid](
                hidden_TD, weight_VD, labels_T, *outs,
                n_tok, vocab, dim,
                hidden_TD.stride(0), hidden_TD.stride(1), weight_VD.stride(0), weight_VD.stride(1),
                num_splits, *scalars, EVEN_K=dim % cfg.block_k == 0, **common,
            )
        LAUNCHES.forward += 1
        return _merge_splits(m_ST, s_ST, a_ST, zy_ST)

    def _forward_cublas(self, hidden_TD, weight_VD, labels_T, temperature, softcap, entropy, chunk_size):
        n_tok = hidden_TD.shape[0]
        vocab = weight_VD.shape[0]
        rows = min(n_tok, chunk_size or default_backward_rows(vocab, elem_bytes=4))
        dev = hidden_TD.device
        m_T = torch.empty(n_tok, dtype=torch.float32, device=dev)
        s_T = torch.empty_like(m_T)
        zy_T = torch.empty_like(m_T)
        a_T = torch.empty_like(m_T) if entropy else None
        logits_CV = torch.empty(rows, vocab, dtype=torch.float32, device=dev)
        for start in range(0, n_tok, rows):
            end = min(start + rows, n_tok)
            l_CV = logits_CV[: end - start]
            _mm_fp32(hidden_TD[start:end], weight_VD.t(), l_CV)
            _rows_stats_kernel[(end - start,)](
                l_CV, labels_T[start:end], m_T[start:], s_T[start:], (a_T if entropy else m_T)[start:],
                zy_T[start:],
                vocab, l_CV.stride(0),
                1.0 / temperature, softcap or 1.0, 1.0 / (softcap or 1.0),
                HAS_SOFTCAP=softcap is not None, ENTROPY=entropy, BLOCK=1024, num_warps=4,
            )
            LAUNCHES.forward += 1
        return m_T, s_T, a_T, zy_T

    # ------------------------------------------------------------------ backward
    def backward(
        self,
        hidden_TD,
        weight_VD,
        labels_T,
        lse_T,
        ent_T,
        grad_logprob_T,
        grad_ent_T,
        *,
        temperature,
        softcap,
        chunk_size,
        need_hidden,
        need_weight,
    ):
        n_tok, dim = hidden_TD.shape
        vocab = weight_VD.shape[0]
        cfg = self.bwd
        cublas = self.bwd_mode == "cublas"
        rows = min(n_tok, chunk_size or default_backward_rows(vocab))
        dev = hidden_TD.device
        v_pad = triton.cdiv(vocab, 64) * 64  # 128-byte aligned rows for cuBLAS
        work_CV = torch.empty(rows, v_pad, dtype=hidden_TD.dtype, device=dev)
        logits_CV = torch.empty(rows, vocab, dtype=torch.float32, device=dev) if cublas else None
        labels_T = labels_T.contiguous()
        grad_h = torch.empty(hidden_TD.shape, dtype=hidden_TD.dtype, device=dev) if need_hidden else None
        grad_w = torch.empty(weight_VD.shape, dtype=weight_VD.dtype, device=dev) if need_weight else None
        has_glp, has_gent = grad_logprob_T is not None, grad_ent_T is not None
        dummy = lse_T
        flags = dict(HAS_SOFTCAP=softcap is not None, HAS_GLP=has_glp, HAS_GENT=has_gent)
        scalars = (1.0 / temperature, softcap or 1.0, 1.0 / (softcap or 1.0))
        for start in range(0, n_tok, rows):
            end = min(start + rows, n_tok)
            n_c = end - start
            h_CD = hidden_TD[start:end]
            per_tok = (
                labels_T[start:end],
                lse_T[start:end],
                ent_T[start:end] if has_gent else dummy,
                grad_logprob_T[start:end] if has_glp else dummy,
                grad_ent_T[start:end] if has_gent else dummy,
            )
            if cublas:
                l_CV = logits_CV[:n_c]
                _mm_fp32(h_CD, weight_VD.t(), l_CV)
                blk = self.rows_block
                _rows_grad_kernel[(n_c, triton.cdiv(vocab, blk))](
                    l_CV, work_CV, *per_tok,
                    vocab, l_CV.stride(0), work_CV.stride(0),
                    *scalars, **flags, BLOCK=blk, num_warps=8,
                )
            else:
                grid = (triton.cdiv(n_c, cfg.block_t) * triton.cdiv(vocab, cfg.block_v),)
                common = dict(
                    **flags, BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                )
                if self.bwd_tma and _tma_ok(h_CD, weight_VD, work_CV):
                    LAUNCHES.tma += 1
                    _bwd_grad_logits_kernel_tma[grid](
                        _desc(h_CD, [cfg.block_t, cfg.block_k]),
                        _desc(weight_VD, [cfg.block_v, cfg.block_k]),
                        _desc(work_CV, [cfg.block_t, cfg.block_v], shape=[n_c, vocab]),
                        *per_tok, n_c, vocab, dim, *scalars, **common,
                    )
                else:
                    _bwd_grad_logits_kernel[grid](
                        h_CD, weight_VD, work_CV, *per_tok,
                        n_c, vocab, dim,
                        h_CD.stride(0), h_CD.stride(1), weight_VD.stride(0), weight_VD.stride(1),
                        work_CV.stride(0), *scalars, EVEN_K=dim % cfg.block_k == 0, **common,
                    )
            LAUNCHES.backward += 1
            g_CV = work_CV[:n_c, :vocab]
            if grad_h is not None:
                torch.mm(g_CV, weight_VD, out=grad_h[start:end])
            if grad_w is not None:
                if start == 0:
                    torch.mm(g_CV.t(), h_CD, out=grad_w)
                else:
                    grad_w.addmm_(g_CV.t(), h_CD)
        return grad_h, grad_w


TRITON_ENGINE = TritonEngine()
