"""Triton device kernels of the log-prob head (imports triton at module top; loaded only on the Triton path).

Shape suffixes: T tokens, D hidden, V vocab (this rank's rows under tensor parallelism), C tokens of one
backward block. What each kernel computes and why it is shaped so: ``triton_engine`` (the launches) and
docs/benchmarks.md (the measurements).
"""

import triton
import triton.language as tl

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps 0 * (z - m) at 0 for masked columns


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits at +-inf, absolute error ~1e-7 near 0.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _online_update(acc, offs_v, labels, V, m, s, a, zy, inv_temp, softcap, inv_softcap,
                   HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr):
    """Fold one [BLOCK_T, BLOCK_V] tile of raw fp32 logits into the per-token running statistics.

    Also returns the tile's ``z - m_new`` (the loss-fused kernel stores it; other callers drop it).
    """
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
    return m_new, s, a, zy, zc


@triton.jit
def _grad_logits(x, hit, lse, ent, glp, gent, inv_temp, softcap, inv_softcap,
                 HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr):
    """grad of (glp * logprob + gent * entropy) w.r.t. raw fp32 logits ``x``.

    ``hit`` marks the label's column; the per-token values broadcast against ``x`` (tiles pass
    [BLOCK_T, 1] columns). Unused per-token values may be anything.
    """
    if HAS_SOFTCAP:
        z = _tanh(x * inv_softcap) * softcap * inv_temp
    else:
        z = x * inv_temp
    return _grad_of_z(z, hit, lse, ent, glp, gent, inv_temp, softcap, HAS_SOFTCAP, HAS_GLP, HAS_GENT)


@triton.jit
def _grad_of_z(z, hit, lse, ent, glp, gent, inv_temp, softcap,
               HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr):
    """``_grad_logits`` from the scaled (capped) logits z: with a softcap, tanh(x / cap) = z * T / cap."""
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
        t = z * (1.0 / (softcap * inv_temp))
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
def _logits_tile(h_base, w_base, D, stride_hd, stride_wd, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 [BLOCK_T, BLOCK_V] logits from pointer loads (``h_base`` / ``w_base``: the rows' base pointers)."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k in range(0, D, BLOCK_K):
        kk = k + offs_k
        if EVEN_K:
            x = tl.load(h_base + kk[None, :] * stride_hd)
            y = tl.load(w_base + kk[:, None] * stride_wd)
        else:
            x = tl.load(h_base + kk[None, :] * stride_hd, mask=kk[None, :] < D, other=0.0)
            y = tl.load(w_base + kk[:, None] * stride_wd, mask=kk[:, None] < D, other=0.0)
        acc = tl.dot(x, y, acc)
    return acc


@triton.jit
def _empty_stats(BLOCK_T: tl.constexpr):
    """Running (m, s, a, zy) of a token tile before any vocabulary tile."""
    zero = tl.zeros((BLOCK_T,), tl.float32)
    return tl.full((BLOCK_T,), _NEG, tl.float32), zero, zero, zero


@triton.jit
def _store_split_stats(m_ptr, s_ptr, a_ptr, zy_ptr, split_start, offs_t, T, m, s, a, zy, ENTROPY: tl.constexpr):
    """Write a token tile's statistics into row ``split_start // T`` of the [S, T] partials."""
    out = split_start + offs_t
    ok = offs_t < T
    tl.store(m_ptr + out, m, mask=ok)
    tl.store(s_ptr + out, s, mask=ok)
    tl.store(zy_ptr + out, zy, mask=ok)
    if ENTROPY:
        tl.store(a_ptr + out, a, mask=ok)


@triton.jit
def fwd_stats_kernel(
    h_ptr, w_ptr, lab_ptr, m_ptr, s_ptr, a_ptr, zy_ptr,
    T, V, D,
    stride_ht, stride_hd, stride_wv, stride_wd,
    num_splits,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, EVEN_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """Per-split statistics of a token tile: ``TILES_PER_SPLIT`` vocabulary tiles from the split's start."""
    pid_t, pid_s = _tile_ids(tl.program_id(0), tl.cdiv(T, BLOCK_T), num_splits, GROUP)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rows_t = (offs_t % T).to(tl.int64)
    labels = tl.load(lab_ptr + rows_t).to(tl.int64)
    v_lo = pid_s * (TILES_PER_SPLIT * BLOCK_V)
    m, s, a, zy = _empty_stats(BLOCK_T)
    h_base = h_ptr + rows_t[:, None] * stride_ht
    # constant trip count (the last split may run a few fully masked tiles; 1% at V=151936)
    for i in range(0, TILES_PER_SPLIT):
        offs_v = v_lo + i * BLOCK_V + tl.arange(0, BLOCK_V)
        w_base = w_ptr + (offs_v % V).to(tl.int64)[None, :] * stride_wv
        acc = _logits_tile(h_base, w_base, D, stride_hd, stride_wd, BLOCK_T, BLOCK_V, BLOCK_K, EVEN_K)
        m, s, a, zy, _ = _online_update(acc, offs_v, labels, V, m, s, a, zy, inv_temp, softcap, inv_softcap,
                                        HAS_SOFTCAP, ENTROPY)
    _store_split_stats(m_ptr, s_ptr, a_ptr, zy_ptr, pid_s * T, offs_t, T, m, s, a, zy, ENTROPY)


@triton.jit
def fwd_stats_kernel_tma(
    h_desc, w_desc, lab_ptr, m_ptr, s_ptr, a_ptr, zy_ptr,
    T, V, D,
    num_splits,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """As ``fwd_stats_kernel`` with TMA tile loads (zero fill out of bounds, no address arithmetic).
    ``FLATTEN``: one pipelined loop over (tile, K) so the next tile's loads overlap this tile's epilogue."""
    pid_t, pid_s = _tile_ids(tl.program_id(0), tl.cdiv(T, BLOCK_T), num_splits, GROUP)
    off_t = pid_t * BLOCK_T
    offs_t = off_t + tl.arange(0, BLOCK_T)
    rows_t = (offs_t % T).to(tl.int64)
    labels = tl.load(lab_ptr + rows_t).to(tl.int64)
    v_lo = pid_s * (TILES_PER_SPLIT * BLOCK_V)
    m, s, a, zy = _empty_stats(BLOCK_T)
    for i in tl.range(0, TILES_PER_SPLIT, flatten=FLATTEN):
        off_v = v_lo + i * BLOCK_V
        offs_v = off_v + tl.arange(0, BLOCK_V)
        acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for k in range(0, D, BLOCK_K):
            x = h_desc.load([off_t, k])
            y = w_desc.load([off_v, k])
            acc = tl.dot(x, y.T, acc)
        m, s, a, zy, _ = _online_update(acc, offs_v, labels, V, m, s, a, zy, inv_temp, softcap, inv_softcap,
                                        HAS_SOFTCAP, ENTROPY)
    _store_split_stats(m_ptr, s_ptr, a_ptr, zy_ptr, pid_s * T, offs_t, T, m, s, a, zy, ENTROPY)


@triton.jit
def bwd_grad_logits_kernel(
    h_ptr, w_ptr, g_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
    C, V, D, v_start,
    stride_ht, stride_hd, stride_wv, stride_wd, stride_gc,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """grad_logits of one [BLOCK_T, BLOCK_V] tile of a backward block, its logits recomputed by tl.dot.

    Pointer loads, one tile per program: the engine runs it where TMA cannot load the layout (elsewhere
    ``bwd_grad_logits_persistent_kernel``, measured faster: docs/bench_head.md).
    """
    pid_t, pid_v = _tile_ids(tl.program_id(0), tl.cdiv(C, BLOCK_T), tl.cdiv(V, BLOCK_V), GROUP)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    rows_t = (offs_t % C).to(tl.int64)
    h_base = h_ptr + rows_t[:, None] * stride_ht
    w_base = w_ptr + (offs_v % V).to(tl.int64)[None, :] * stride_wv
    acc = _logits_tile(h_base, w_base, D, stride_hd, stride_wd, BLOCK_T, BLOCK_V, BLOCK_K, EVEN_K)
    g = _grad_tile(acc, offs_v, rows_t, v_start, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp, softcap,
                   inv_softcap, HAS_SOFTCAP, HAS_GLP, HAS_GENT)
    ok = (offs_t[:, None] < C) & (offs_v[None, :] < V)
    g_ptrs = g_ptr + offs_t.to(tl.int64)[:, None] * stride_gc + offs_v[None, :]
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=ok)
