"""Triton backend (CUDA, bf16/fp16 inputs): fused lm-head matmul + online logsumexp/entropy.

Shape suffixes: T tokens, D hidden, V vocab (this rank's rows under tensor parallelism), C tokens
of one backward chunk, S vocabulary splits of the forward grid. Imported only when the Triton backend
is chosen (it imports triton at module top).

Forward: one launch over a grid of (token tile x vocabulary split). Each program streams its split of
the vocabulary in [BLOCK_T, BLOCK_V] logit tiles (tl.dot, fp32 accumulators: logits are never rounded
to 16 bits) and keeps per-token online statistics (running max m, sum exp s, sum exp*(z-m) a, the
label's logit). The [S, T] partials are merged by a few torch ops. Memory: O(T * S) floats.

Backward, per block of C tokens and B vocabulary rows: a GEMM-shaped kernel recomputes the logits
tile by tile and writes grad_logits (fp32 math, stored in the input dtype, as Liger does) into a
[C, B] workspace; cuBLAS then accumulates grad_hidden[C] += G @ W[B] into an fp32 [C, D] accumulator
(rounded to the input dtype once per token block) and grad_weight[B] += G^T @ h[C] (fp32 inside each
matmul, rounded to the weight dtype once per token block). Blocking the vocabulary as well as the
tokens keeps the workspace small (64 MiB: the issue's N=32768, H=4096, V=151936 case stays under
1.5 GiB with its 1.41 GiB of returned gradients) while the token block stays large enough for
efficient grad_weight updates and few roundings. No atomics: results are identical run to run.

``fused_loss_forward`` (the loss-fused head, ``fused_loss.py``) computes a chunk's fp32 logits (cuBLAS by
default, or the forward kernel storing them as it reduces), reduces them, asks the caller for the
per-token loss gradients, overwrites the logits with 16-bit grad_logits in place and runs the two
gradient matmuls: 6NHV instead of 8NHV.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from actorcore.kernels.logprob._common import finish_stats


logger = logging.getLogger(__name__)

# Backward workspace in bytes: the fp32 grad_hidden accumulator of one token block plus its 16-bit
# [tokens, vocabulary block] grad_logits tile (``backward_blocks``).
BACKWARD_WORKSPACE_BYTES = 64 << 20
# Vocabulary rows per backward block (a multiple of every BLOCK_V used here). With 64 MiB this gives
# 2048-token blocks at H=4096; ``bench/logprob.py --sweep`` measured it fastest of the blockings tried.
BACKWARD_VOCAB_BLOCK = 8192
# Bytes of the fp32 logits buffer of one chunk of the loss-fused forward: 1024 tokens at V=151936
# (``bench/logprob.py --sweep``: 512 / 768 / 1024 / 2048-token chunks took 112 / 107 / 102 / 100 ms at
# N=16384, H=4096).
FUSED_LOSS_WORKSPACE_BYTES = 640 << 20

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps 0 * (z - m) at 0 for masked columns


@dataclass
class LaunchCounter:
    """How many forward / backward Triton launches ran; tests use it to prove this path was taken."""

    forward: int = 0
    backward: int = 0
    tma: int = 0  # launches of the TMA variants (a subset of the two above)
    fused_loss: int = 0  # chunks run by the loss-fused forward


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
# The forward that also stores fp32 logits (loss-fused path): the TMA store stages a whole fp32 tile in
# shared memory (128 KB at 128 x 256), so the 3-stage pipeline above no longer fits in 227 KB.
FWD_STORE_CONFIG = Config(block_t=128, block_v=256, block_k=64, num_warps=8, num_stages=2, group=16)


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
def _grad_logits(x, hit, lse, ent, glp, gent, inv_temp, softcap, inv_softcap,
                 HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr):
    """grad of (glp * logprob + gent * entropy) w.r.t. raw fp32 logits ``x``.

    ``hit`` marks the label's column; the per-token values broadcast against ``x`` (tiles pass
    [BLOCK_T, 1] columns, row kernels pass scalars). Unused per-token values may be anything.
    """
    if HAS_SOFTCAP:
        t = _tanh(x * inv_softcap)
        z = t * softcap * inv_temp
    else:
        z = x * inv_temp
    logp = z - lse
    p = tl.exp(logp)
    if HAS_GENT:
        coef = gent * (logp + ent)
        if HAS_GLP:
            coef += glp
        g = -p * coef
    else:
        g = -p * glp
    if HAS_GLP:
        g += tl.where(hit, glp, 0.0)
    g = g * inv_temp
    if HAS_SOFTCAP:
        g = g * (1.0 - t * t)
    return g


@triton.jit
def _grad_tile(acc, offs_v, rows_t, v_start, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp, softcap,
               inv_softcap, HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr):
    """``_grad_logits`` of one [BLOCK_T, BLOCK_V] tile; ``offs_v`` count from vocabulary row ``v_start``."""
    lse = tl.load(lse_ptr + rows_t)[:, None]
    ent = tl.load(ent_ptr + rows_t)[:, None]
    glp = tl.load(glp_ptr + rows_t)[:, None]
    gent = tl.load(gent_ptr + rows_t)[:, None]
    labels = tl.load(lab_ptr + rows_t).to(tl.int64) - v_start
    hit = offs_v[None, :] == labels[:, None]
    return _grad_logits(acc, hit, lse, ent, glp, gent, inv_temp, softcap, inv_softcap,
                        HAS_SOFTCAP, HAS_GLP, HAS_GENT)


@triton.jit
def _tile_ids(pid, num_t_tiles, num_other, GROUP: tl.constexpr):
    """Grouped launch order: GROUP token tiles x all vocabulary tiles/splits run together (L2 reuse)."""
    per_group = GROUP * num_other
    first_t = (pid // per_group) * GROUP
    group_size = tl.minimum(num_t_tiles - first_t, GROUP)
    return first_t + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _fwd_stats_kernel(
    h_ptr, w_ptr, lab_ptr, m_ptr, s_ptr, a_ptr, zy_ptr, l_ptr,
    T, V, D,
    stride_ht, stride_hd, stride_wv, stride_wd, stride_l,
    num_splits,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, EVEN_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """Per-split statistics of a token tile; with STORE_LOGITS also the raw fp32 logits into ``l_ptr``."""
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
        if STORE_LOGITS:
            ok = (offs_t[:, None] < T) & (offs_v[None, :] < V)
            tl.store(l_ptr + offs_t.to(tl.int64)[:, None] * stride_l + offs_v[None, :], acc, mask=ok)
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
    h_desc, w_desc, lab_ptr, m_ptr, s_ptr, a_ptr, zy_ptr, l_desc,
    T, V, D,
    num_splits,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, STORE_LOGITS: tl.constexpr,
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
        if STORE_LOGITS:
            l_desc.store([off_t, off_v], acc)
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
    C, V, D, v_start,
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
    g = _grad_tile(acc, offs_v, rows_t, v_start, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp, softcap,
                   inv_softcap, HAS_SOFTCAP, HAS_GLP, HAS_GENT)
    ok = (offs_t[:, None] < C) & (offs_v[None, :] < V)
    g_ptrs = g_ptr + offs_t.to(tl.int64)[:, None] * stride_gc + offs_v[None, :]
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_grad_logits_kernel_tma(
    h_desc, w_desc, g_desc, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
    C, V, D, v_start,
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
    g = _grad_tile(acc, offs_v, rows_t, v_start, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp, softcap,
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
    V, v_start, stride_l, stride_g,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_logits of one [1, BLOCK] piece from precomputed fp32 logits (the cuBLAS-recompute mode)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(l_ptr + row * stride_l + offs, mask=ok, other=0.0)
    hit = offs == tl.load(lab_ptr + row).to(tl.int64) - v_start
    g = _grad_logits(x, hit, tl.load(lse_ptr + row), tl.load(ent_ptr + row), tl.load(glp_ptr + row),
                     tl.load(gent_ptr + row), inv_temp, softcap, inv_softcap, HAS_SOFTCAP, HAS_GLP, HAS_GENT)
    tl.store(g_ptr + row * stride_g + offs, g.to(g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rows_grad_inplace_kernel(
    l_ptr, g_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
    V, stride_l, stride_g,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_logits of one row written over that row's fp32 logits (``g_ptr`` is a 16-bit view of them).

    Element j of G lands on bytes [2j, 2j+2) of the row, i.e. inside fp32 elements already read: one
    program walks the row in order, and a barrier between each piece's loads and its stores keeps every
    warp's reads ahead of the writes that overwrite them.
    """
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(lab_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    ent = tl.load(ent_ptr + row)
    glp = tl.load(glp_ptr + row)
    gent = tl.load(gent_ptr + row)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(l_ptr + row * stride_l + offs, mask=ok, other=0.0)
        g = _grad_logits(x, offs == label, lse, ent, glp, gent, inv_temp, softcap, inv_softcap,
                         HAS_SOFTCAP, HAS_GLP, HAS_GENT)
        tl.debug_barrier()
        tl.store(g_ptr + row * stride_g + offs, g.to(g_ptr.dtype.element_ty), mask=ok)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b with fp32 accumulation and an fp32 result (cuBLAS writes its accumulator directly)."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:  # the CPU interpreter (TRITON_INTERPRET=1) and fp32 inputs
        torch.mm(a.float(), b.float(), out=out)


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for 16-bit a, b and an fp32 acc, without rounding the product to 16 bits."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # the CPU interpreter (TRITON_INTERPRET=1) and fp32 inputs
        acc.add_(torch.mm(a.float(), b.float()))


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned base and row strides."""
    for t in tensors:
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def _desc(t: torch.Tensor, block: list[int], shape: list[int] | None = None):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(shape or t.shape), list(t.stride()), block)


def backward_blocks(
    n_tok: int, dim: int, vocab: int, *, need_hidden: bool, vocab_block: int = BACKWARD_VOCAB_BLOCK,
    budget: int = BACKWARD_WORKSPACE_BYTES, elem_bytes: int = 2,
) -> tuple[int, int]:
    """(tokens, vocabulary rows) of one backward block so its workspace stays within ``budget`` bytes.

    The workspace is the [tokens, rows] grad_logits tile plus, when grad_hidden is wanted and the
    vocabulary spans several blocks, an fp32 [tokens, D] grad_hidden accumulator.
    """
    rows_v = min(vocab, vocab_block)
    per_token = elem_bytes * rows_v + (4 * dim if need_hidden and rows_v < vocab else 0)
    tokens = max(1, budget // per_token)
    if tokens >= 256:
        tokens -= tokens % 128
    return min(tokens, n_tok), rows_v


def default_loss_rows(vocab: int, budget: int = FUSED_LOSS_WORKSPACE_BYTES) -> int:
    """Tokens per chunk of the loss-fused forward: its fp32 [C, V] logits buffer stays within ``budget``."""
    rows = max(1, budget // (4 * vocab))
    return rows - rows % 128 if rows >= 256 else rows


def forward_tiles_per_split(t_tiles: int, v_tiles: int, sms: int, lo: int = 4, hi: int = 32) -> int:
    """Vocabulary tiles per forward program, chosen against wave quantization.

    The forward runs t_tiles * cdiv(v_tiles, k) equal programs of k tiles each, so its time goes as
    ceil(programs / sms) * k. A chunk of a few token tiles (the loss-fused path) is otherwise a launch
    of a couple of ragged waves. Ties go to the larger k (fewer partial statistics to merge).
    """
    def cost(k):
        return triton.cdiv(t_tiles * triton.cdiv(v_tiles, k), sms) * k

    return min(range(hi, lo - 1, -1), key=cost)


def _sm_count(t: torch.Tensor) -> int:
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 132


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
    ``vocab_block`` / ``workspace_bytes``: the backward's blocking (``backward_blocks``).
    ``loss_logits``: who writes the loss-fused path's fp32 logits: "cublas" (then a row kernel reduces
    them) or "fused" (the forward kernel stores them as it reduces; measured 8% slower on the H200).
    """

    name = "triton"

    def __init__(
        self,
        fwd: Config = FWD_CONFIG,
        bwd: Config = BWD_CONFIG,
        fwd_store: Config = FWD_STORE_CONFIG,
        loss_logits: str = "cublas",
        fwd_mode: str = "fused",
        bwd_mode: str = "fused",
        rows_block: int = 4096,
        tma: bool = True,
        bwd_tma: bool = False,
        vocab_block: int = BACKWARD_VOCAB_BLOCK,
        workspace_bytes: int = BACKWARD_WORKSPACE_BYTES,
    ):
        if {fwd_mode, bwd_mode, loss_logits} - {"fused", "cublas"}:
            raise ValueError(f"modes must be 'fused' or 'cublas', got {fwd_mode!r}, {bwd_mode!r}, {loss_logits!r}")
        self.fwd = fwd
        self.bwd = bwd
        self.fwd_store = fwd_store
        self.loss_logits = loss_logits
        self.fwd_mode = fwd_mode
        self.bwd_mode = bwd_mode
        self.rows_block = rows_block
        self.tma = tma
        self.bwd_tma = bwd_tma
        self.vocab_block = vocab_block
        self.workspace_bytes = workspace_bytes

    # ------------------------------------------------------------------ forward
    def forward_stats(self, hidden_TD, weight_VD, labels_T, *, temperature, softcap, entropy, chunk_size):
        labels_T = labels_T.contiguous()
        if self.fwd_mode == "cublas":
            return self._forward_cublas(hidden_TD, weight_VD, labels_T, temperature, softcap, entropy, chunk_size)
        return self._forward_fused(hidden_TD, weight_VD, labels_T, temperature, softcap, entropy)

    def _forward_fused(self, hidden_TD, weight_VD, labels_T, temperature, softcap, entropy, logits_TV=None):
        """One launch over (token tiles x vocabulary splits); ``logits_TV`` (fp32) also receives the logits."""
        n_tok, dim = hidden_TD.shape
        vocab = weight_VD.shape[0]
        cfg = self.fwd if logits_TV is None else self.fwd_store
        v_tiles = triton.cdiv(vocab, cfg.block_v)
        tiles_per_split = forward_tiles_per_split(triton.cdiv(n_tok, cfg.block_t), v_tiles, _sm_count(hidden_TD))
        num_splits = triton.cdiv(v_tiles, tiles_per_split)
        dev = hidden_TD.device
        m_ST = torch.empty(num_splits, n_tok, dtype=torch.float32, device=dev)
        s_ST = torch.empty_like(m_ST)
        zy_ST = torch.empty_like(m_ST)
        a_ST = torch.empty_like(m_ST) if entropy else None
        grid = (triton.cdiv(n_tok, cfg.block_t) * num_splits,)
        common = dict(
            HAS_SOFTCAP=softcap is not None, ENTROPY=entropy, TILES_PER_SPLIT=tiles_per_split,
            STORE_LOGITS=logits_TV is not None,
            BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        scalars = (1.0 / temperature, softcap or 1.0, 1.0 / (softcap or 1.0))
        outs = (m_ST, s_ST, a_ST if entropy else m_ST, zy_ST)
        store_ok = logits_TV is None or _tma_ok(logits_TV)
        if self.tma and store_ok and _tma_ok(hidden_TD, weight_VD):
            LAUNCHES.tma += 1
            h_desc = _desc(hidden_TD, [cfg.block_t, cfg.block_k])
            l_desc = h_desc if logits_TV is None else _desc(logits_TV, [cfg.block_t, cfg.block_v])
            _fwd_stats_kernel_tma[grid](
                h_desc, _desc(weight_VD, [cfg.block_v, cfg.block_k]), labels_T, *outs, l_desc,
                n_tok, vocab, dim, num_splits, *scalars, **common,
            )
        else:
            l_TV = hidden_TD if logits_TV is None else logits_TV
            _fwd_stats_kernel[grid](
                hidden_TD, weight_VD, labels_T, *outs, l_TV,
                n_tok, vocab, dim,
                hidden_TD.stride(0), hidden_TD.stride(1), weight_VD.stride(0), weight_VD.stride(1), l_TV.stride(0),
                num_splits, *scalars, EVEN_K=dim % cfg.block_k == 0, **common,
            )
        LAUNCHES.forward += 1
        return _merge_splits(m_ST, s_ST, a_ST, zy_ST)

    def _forward_cublas(self, hidden_TD, weight_VD, labels_T, temperature, softcap, entropy, chunk_size):
        n_tok = hidden_TD.shape[0]
        vocab = weight_VD.shape[0]
        rows = min(n_tok, chunk_size or default_loss_rows(vocab))
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
            _rows_stats(l_CV, labels_T[start:end], (m_T, s_T, a_T, zy_T), start, temperature, softcap)
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
        """Blocked over tokens (``chunk_size`` or ``backward_blocks``) and vocabulary rows (``vocab_block``)."""
        n_tok, dim = hidden_TD.shape
        vocab = weight_VD.shape[0]
        rows, rows_v = backward_blocks(
            n_tok, dim, vocab, need_hidden=need_hidden, vocab_block=self.vocab_block, budget=self.workspace_bytes
        )
        if chunk_size:
            rows = min(n_tok, chunk_size)
        dev = hidden_TD.device
        work_CB = torch.empty(rows, triton.cdiv(rows_v, 64) * 64, dtype=hidden_TD.dtype, device=dev)
        logits_CB = torch.empty(rows, rows_v, dtype=torch.float32, device=dev) if self.bwd_mode == "cublas" else None
        one_block = rows_v == vocab
        acc_CD = torch.empty(rows, dim, dtype=torch.float32, device=dev) if need_hidden and not one_block else None
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
            for v0 in range(0, vocab, rows_v):
                v1 = min(v0 + rows_v, vocab)
                w_BD = weight_VD[v0:v1]
                g_CB = work_CB[:n_c, : v1 - v0]
                if logits_CB is not None:
                    self._grad_logits_cublas(h_CD, w_BD, v0, per_tok, logits_CB[:n_c, : v1 - v0], g_CB, flags, scalars)
                else:
                    self._grad_logits_fused(h_CD, w_BD, v0, per_tok, g_CB, flags, scalars)
                LAUNCHES.backward += 1
                if need_hidden and one_block:
                    torch.mm(g_CB, w_BD, out=grad_h[start:end])
                elif need_hidden and v0 == 0:
                    _mm_fp32(g_CB, w_BD, acc_CD[:n_c])
                elif need_hidden:
                    _addmm_fp32(acc_CD[:n_c], g_CB, w_BD)
                if need_weight and start == 0:
                    torch.mm(g_CB.t(), h_CD, out=grad_w[v0:v1])
                elif need_weight:
                    grad_w[v0:v1].addmm_(g_CB.t(), h_CD)
            if need_hidden and not one_block:
                grad_h[start:end].copy_(acc_CD[:n_c])
        return grad_h, grad_w

    def _grad_logits_fused(self, h_CD, w_BD, v_start, per_tok, g_CB, flags, scalars):
        """g_CB = grad_logits of (tokens h_CD) x (vocabulary rows w_BD), logits recomputed in Triton."""
        cfg = self.bwd
        (n_c, dim), n_v = h_CD.shape, w_BD.shape[0]
        grid = (triton.cdiv(n_c, cfg.block_t) * triton.cdiv(n_v, cfg.block_v),)
        common = dict(
            **flags, BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP=cfg.group,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if self.bwd_tma and _tma_ok(h_CD, w_BD, g_CB):
            LAUNCHES.tma += 1
            _bwd_grad_logits_kernel_tma[grid](
                _desc(h_CD, [cfg.block_t, cfg.block_k]),
                _desc(w_BD, [cfg.block_v, cfg.block_k]),
                _desc(g_CB, [cfg.block_t, cfg.block_v]),
                *per_tok, n_c, n_v, dim, v_start, *scalars, **common,
            )
        else:
            _bwd_grad_logits_kernel[grid](
                h_CD, w_BD, g_CB, *per_tok,
                n_c, n_v, dim, v_start,
                h_CD.stride(0), h_CD.stride(1), w_BD.stride(0), w_BD.stride(1),
                g_CB.stride(0), *scalars, EVEN_K=dim % cfg.block_k == 0, **common,
            )

    def _grad_logits_cublas(self, h_CD, w_BD, v_start, per_tok, l_CB, g_CB, flags, scalars):
        """As ``_grad_logits_fused`` with the logits recomputed by cuBLAS into the fp32 buffer ``l_CB``."""
        _mm_fp32(h_CD, w_BD.t(), l_CB)
        blk = self.rows_block
        _rows_grad_kernel[(h_CD.shape[0], triton.cdiv(w_BD.shape[0], blk))](
            l_CB, g_CB, *per_tok,
            w_BD.shape[0], v_start, l_CB.stride(0), g_CB.stride(0),
            *scalars, **flags, BLOCK=blk, num_warps=8,
        )

    # ------------------------------------------------------------------ loss-fused forward
    def fused_loss_forward(
        self, hidden_TD, weight_VD, labels_T, token_grads, *, temperature, softcap, entropy, chunk_size,
        need_hidden, need_weight,
    ):
        """Per-token (logprob, entropy) and, in the same pass, grad_hidden and grad_weight of a token-wise loss.

        ``token_grads(start, end, logprob_C, entropy_C)`` is called once per chunk, in order, and returns
        the loss's gradients w.r.t. the chunk's log-probs and entropies (None where the loss does not use
        them or no gradient is wanted). Per chunk of C tokens:
        fp32 logits (cuBLAS and a row kernel, or the forward kernel storing them as it reduces: ``loss_logits``),
        the caller's gradients, 16-bit grad_logits written over the logits, then grad_hidden = G @ W (rounded once) and grad_weight += G^T @ h (rounded once per chunk).
        """
        n_tok, dim = hidden_TD.shape
        vocab = weight_VD.shape[0]
        rows = min(n_tok, chunk_size or default_loss_rows(vocab))
        dev = hidden_TD.device
        v_pad = triton.cdiv(vocab, 64) * 64  # 16-byte aligned rows for the 16-bit view
        logits_CV = torch.empty(rows, v_pad, dtype=torch.float32, device=dev)
        grads_CV = logits_CV.view(hidden_TD.dtype)  # [rows, 2 * v_pad]: G of row r starts at row r's byte 0
        labels_T = labels_T.contiguous()
        stats = None  # the cuBLAS mode's per-token statistics (the forward kernel returns its own)
        if self.loss_logits == "cublas":
            stats = [torch.empty(n_tok, dtype=torch.float32, device=dev) if entropy or i != 2 else None
                     for i in range(4)]
        logprob_T = torch.empty(n_tok, dtype=torch.float32, device=dev)
        ent_T = torch.empty(n_tok, dtype=torch.float32, device=dev) if entropy else None
        grad_h = torch.empty(hidden_TD.shape, dtype=hidden_TD.dtype, device=dev) if need_hidden else None
        grad_w = torch.zeros(weight_VD.shape, dtype=weight_VD.dtype, device=dev) if need_weight else None
        scalars = (1.0 / temperature, softcap or 1.0, 1.0 / (softcap or 1.0))
        for start in range(0, n_tok, rows):
            end = min(start + rows, n_tok)
            n_c = end - start
            h_CD = hidden_TD[start:end]
            l_CV = logits_CV[:n_c, :vocab]
            if self.loss_logits == "cublas":
                _mm_fp32(h_CD, weight_VD.t(), l_CV)
                _rows_stats(l_CV, labels_T[start:end], stats, start, temperature, softcap)
                chunk_stats = (None if x is None else x[start:end] for x in stats)
            else:
                chunk_stats = self._forward_fused(h_CD, weight_VD, labels_T[start:end], temperature, softcap,
                                                  entropy, logits_TV=l_CV)
            LAUNCHES.fused_loss += 1
            lse_C, logprob_T[start:end], ent_C = finish_stats(*chunk_stats)
            if ent_T is not None:
                ent_T[start:end] = ent_C
            glp_C, gent_C = token_grads(start, end, logprob_T[start:end], ent_C)
            if not (need_hidden or need_weight):
                continue
            if glp_C is None and gent_C is None:  # this chunk's loss does not depend on the logits
                if need_hidden:
                    grad_h[start:end].zero_()
                continue
            _rows_grad_inplace_kernel[(n_c,)](
                l_CV, grads_CV, labels_T[start:end], lse_C,
                lse_C if gent_C is None else ent_C,
                lse_C if glp_C is None else glp_C.contiguous(),
                lse_C if gent_C is None else gent_C.contiguous(),
                vocab, logits_CV.stride(0), grads_CV.stride(0), *scalars,
                HAS_SOFTCAP=softcap is not None, HAS_GLP=glp_C is not None, HAS_GENT=gent_C is not None,
                BLOCK=2048, num_warps=8,
            )
            g_CV = grads_CV[:n_c, :vocab]
            if not g_CV.is_cuda:  # the CPU interpreter: torch's CPU bf16 mm reads past a strided view's columns
                g_CV = g_CV.contiguous()
            if need_hidden:
                torch.mm(g_CV, weight_VD, out=grad_h[start:end])
            if need_weight:
                grad_w.addmm_(g_CV.t(), h_CD)
        return logprob_T, ent_T, grad_h, grad_w


def _rows_stats(l_CV, labels_C, stats_T, start, temperature, softcap):
    """Statistics (m, s, a, zy) of fp32 logit rows into ``stats_T[i][start:]`` (a may be None)."""
    m_T, s_T, a_T, zy_T = stats_T
    _rows_stats_kernel[(l_CV.shape[0],)](
        l_CV, labels_C, m_T[start:], s_T[start:], (m_T if a_T is None else a_T)[start:], zy_T[start:],
        l_CV.shape[1], l_CV.stride(0),
        1.0 / temperature, softcap or 1.0, 1.0 / (softcap or 1.0),
        HAS_SOFTCAP=softcap is not None, ENTROPY=a_T is not None, BLOCK=1024, num_warps=4,
    )
    LAUNCHES.forward += 1


TRITON_ENGINE = TritonEngine()
