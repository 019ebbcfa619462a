"""Triton kernels of the loss-fused forward and the persistent backward (TMA loads; Triton path only).

Shape suffixes: T tokens (of one chunk), C tokens of one backward block, V vocab rows, D hidden.

- ``fwd_stats_store_kernel``: the forward's matmul + online statistics, which also stores each logit tile
  as ``z - m`` in fp16 (``m`` the token's running maximum after the tile, stored per token and tile), so
  the loss-fused path needs no fp32 logits buffer and no separate statistics pass. z - m <= 0, and a
  token's probability is at most exp(z - m), so fp16's 11 significant bits put at most
  max_x(x e^-x) * 2^-11 = 1.8e-4 of absolute error on any probability, under the 16-bit rounding of the
  gradient itself; the statistics come from the fp32 accumulators.
- ``shifted_to_grad_kernel``: one memory-bound pass turning those fp16 values into 16-bit grad_logits
  in place, once the token's statistics and its loss gradients are known.
- ``bwd_grad_logits_persistent_kernel``: the per-token backward's recompute kernel as a persistent grid
  (one program per SM looping over tiles), so one tile's epilogue and store overlap the next tile's loads.
"""

import triton
import triton.language as tl

from actorcore.kernels.logprob.triton_kernels import (
    _empty_stats,
    _grad_of_z,
    _grad_tile,
    _online_update,
    _store_split_stats,
    _tile_ids,
)

_FP16_FLOOR = tl.constexpr(-30000.0)  # z - m below this is stored as this (exp underflows to 0 either way)


@triton.jit
def fwd_stats_store_kernel(
    h_desc, w_desc, z_desc, z_ptr, lab_ptr, m_ptr, s_ptr, a_ptr, zy_ptr, mt_ptr,
    T, V, D, num_splits, stride_z, num_vtiles,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    TMA_STORE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """``fwd_stats_kernel_tma`` that also writes fp16 z - m tiles into [T, V] and m into [T, num_vtiles] (one m per
    BLOCK_V columns)."""
    pid_t, pid_s = _tile_ids(tl.program_id(0), tl.cdiv(T, BLOCK_T), num_splits, GROUP)
    off_t = pid_t * BLOCK_T
    offs_t = off_t + tl.arange(0, BLOCK_T)
    labels = tl.load(lab_ptr + (offs_t % T).to(tl.int64)).to(tl.int64)
    v_lo = pid_s * (TILES_PER_SPLIT * BLOCK_V)
    m, s, a, zy = _empty_stats(BLOCK_T)
    for i in tl.range(0, TILES_PER_SPLIT, flatten=FLATTEN):
        off_v = v_lo + i * BLOCK_V
        acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for k in range(0, D, BLOCK_K):
            acc = tl.dot(h_desc.load([off_t, k]), w_desc.load([off_v, k]).T, acc)
        vt = pid_s * TILES_PER_SPLIT + i
        m, s, a, zy = _fold_and_store(acc, off_t, off_v, vt, labels, m, s, a, zy, z_desc, z_ptr, mt_ptr,
                                      T, V, stride_z, num_vtiles, inv_temp, softcap, inv_softcap, HAS_SOFTCAP,
                                      ENTROPY, BLOCK_T, BLOCK_V, TMA_STORE)
    _store_split_stats(m_ptr, s_ptr, a_ptr, zy_ptr, pid_s * T, offs_t, T, m, s, a, zy, ENTROPY)


@triton.jit
def _fold_and_store(acc, off_t, off_v, vt, labels, m, s, a, zy, z_desc, z_ptr, mt_ptr, T, V, stride_z, num_vtiles,
                    inv_temp, softcap, inv_softcap, HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, TMA_STORE: tl.constexpr):
    """Fold the logits ``acc`` at (off_t, off_v) into the running statistics; store its fp16 z - m and m."""
    offs_t = off_t + tl.arange(0, BLOCK_T)
    offs_v = off_v + tl.arange(0, BLOCK_V)
    row_ok = offs_t < T
    m, s, a, zy, zc = _online_update(acc, offs_v, labels, V, m, s, a, zy, inv_temp, softcap, inv_softcap,
                                     HAS_SOFTCAP, ENTROPY)
    zq = tl.maximum(zc, _FP16_FLOOR).to(tl.float16)
    if TMA_STORE:
        z_desc.store([off_t, off_v], zq)  # out-of-bounds rows and columns are clipped
    else:
        ok = row_ok[:, None] & (offs_v[None, :] < V)
        tl.store(z_ptr + offs_t.to(tl.int64)[:, None] * stride_z + offs_v[None, :], zq, mask=ok)
    tl.store(mt_ptr + offs_t.to(tl.int64) * num_vtiles + vt, m, mask=row_ok & (vt < num_vtiles))
    return m, s, a, zy


@triton.jit
def shifted_to_grad_kernel(
    z_ptr, g_ptr, mt_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
    V, stride_z, num_vtiles,
    inv_temp, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """grad_logits of BLOCK columns of one row from its fp16 z - m, written over them (``g_ptr``: a 16-bit
    view of the same bytes). A barrier between the loads and the stores keeps every read ahead of the write."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    zc = tl.load(z_ptr + row * stride_z + offs, mask=ok, other=0.0).to(tl.float32)
    zc = tl.maximum(zc, _FP16_FLOOR)  # an fp16 -inf (z - m below fp16's range) would make 0 * inf
    shift = tl.load(mt_ptr + row * num_vtiles + offs // BLOCK_V, mask=ok, other=0.0)
    label = tl.load(lab_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    ent = tl.load(ent_ptr + row)
    glp = tl.load(glp_ptr + row)
    gent = tl.load(gent_ptr + row)
    g = _grad_of_z(zc + shift, offs == label, lse, ent, glp, gent, inv_temp, softcap,
                   HAS_SOFTCAP, HAS_GLP, HAS_GENT)
    tl.debug_barrier()
    tl.store(g_ptr + row * stride_z + offs, g.to(g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def bwd_grad_logits_persistent_kernel(
    h_desc, w_desc, g_desc, g_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
    C, V, D, v_start, stride_gc, num_programs,
    inv_temp, softcap, inv_softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    TMA_STORE: tl.constexpr, FLATTEN: tl.constexpr,
):
    """``bwd_grad_logits_kernel`` over all [BLOCK_T, BLOCK_V] tiles of a block, ``num_programs`` programs each
    taking every ``num_programs``-th tile (grouped order, as the non-persistent launch)."""
    num_t = tl.cdiv(C, BLOCK_T)
    num_v = tl.cdiv(V, BLOCK_V)
    tile_out = tl.program_id(0) - num_programs  # a separate counter for the epilogue (pipeliner-friendly)
    for tile in tl.range(tl.program_id(0), num_t * num_v, num_programs, flatten=FLATTEN):
        pid_t, pid_v = _tile_ids(tile, num_t, num_v, GROUP)
        off_t = pid_t * BLOCK_T
        off_v = pid_v * BLOCK_V
        acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for k in range(0, D, BLOCK_K):
            acc = tl.dot(h_desc.load([off_t, k]), w_desc.load([off_v, k]).T, acc)
        tile_out += num_programs
        pid_t, pid_v = _tile_ids(tile_out, num_t, num_v, GROUP)
        _grad_store(acc, pid_t * BLOCK_T, pid_v * BLOCK_V, g_desc, g_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr,
                    gent_ptr, C, V, v_start, stride_gc, inv_temp, softcap, inv_softcap,
                    HAS_SOFTCAP, HAS_GLP, HAS_GENT, BLOCK_T, BLOCK_V, TMA_STORE)


@triton.jit
def _grad_store(acc, off_t, off_v, g_desc, g_ptr, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, C, V, v_start,
                stride_gc, inv_temp, softcap, inv_softcap, HAS_SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr,
                HAS_GENT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, TMA_STORE: tl.constexpr):
    """grad_logits of the [BLOCK_T, BLOCK_V] logits ``acc`` at (off_t, off_v), stored in g's dtype."""
    offs_t = off_t + tl.arange(0, BLOCK_T)
    offs_v = off_v + tl.arange(0, BLOCK_V)
    rows_t = (offs_t % C).to(tl.int64)
    g = _grad_tile(acc, offs_v, rows_t, v_start, lab_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp,
                   softcap, inv_softcap, HAS_SOFTCAP, HAS_GLP, HAS_GENT).to(g_ptr.dtype.element_ty)
    if TMA_STORE:
        g_desc.store([off_t, off_v], g)
    else:
        ok = (offs_t[:, None] < C) & (offs_v[None, :] < V)
        tl.store(g_ptr + offs_t.to(tl.int64)[:, None] * stride_gc + offs_v[None, :], g, mask=ok)
