"""The varlen layouts that context parallelism hands to flash kernels on the GPU, checked on the CPU: each
segment is attended the way flash kernels do (a causal mask aligned at the bottom right when there are more keys
than queries, a window counted from that corner), in float64, and the result must equal plain softmax attention
over the keys each query may see, per element. The kernels themselves run in tests/gpu/test_cp_attention_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch
from support.attention_reference import plain_attention

from actorcore.context_split import cp_chunk_index, cp_local_positions
from actorcore.kernels.attention.block_attention import merge_attention_blocks, position_runs
from actorcore.kernels.attention.flash_blocks import plan_flash_block
from actorcore.kernels.attention.varlen import prefix_plan
from actorcore.testing.tolerances import TOL


PADDED = [0, 8, 24, 48]  # three segments, multiples of 2*cp for cp = 2 and 4
SCALE = 0.3


def _flash_like(q, k, v, cu_q, cu_k, causal, window=None):
    """What a varlen flash call computes: per segment, ``(out, lse)``; query ``a`` of ``Lq`` sees key ``b`` of
    ``Lk`` iff ``b <= a + Lk - Lq`` (when causal) and ``b > a + Lk - Lq - window``."""
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for qs, qe, ks, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        kk, vv = k[ks:ke].repeat_interleave(groups, 1), v[ks:ke].repeat_interleave(groups, 1)
        scores = torch.einsum("qnh,knh->nqk", q[qs:qe], kk) * SCALE
        a, b = torch.arange(qe - qs)[:, None], torch.arange(ke - ks)[None, :]
        shift = (ke - ks) - (qe - qs)
        allowed = b <= a + shift if causal else torch.ones_like(b <= a, dtype=torch.bool).expand(qe - qs, ke - ks)
        if window:
            allowed = allowed & (b > a + shift - window)
        scores = scores.masked_fill(~allowed, -math.inf)
        lses.append(torch.logsumexp(scores, -1).t())
        outs.append(torch.einsum("nqk,knh->qnh", torch.softmax(scores, -1), vv))
    return torch.cat(outs), torch.cat(lses)


def _reference(q, keys, values, cu_local, positions, window):
    bounds = cu_local.tolist()
    return torch.cat([plain_attention(q[qs:qe], keys[ks:ke], values[ks:ke], positions[qs:qe], window, SCALE)
                      for qs, qe, ks, ke in zip(bounds[:-1], bounds[1:], PADDED[:-1], PADDED[1:])])


@pytest.mark.parametrize("cp,window", [(2, None), (2, 5), (4, None), (4, 11)])
def test_prefix_plan_under_flash_masks_equals_plain_softmax(cp, window):
    """The all-gather path: every run of a rank's query positions over its segment's key prefix (or band)."""
    gen = torch.Generator().manual_seed(11)
    keys = torch.randn(PADDED[-1], 2, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(PADDED[-1], 2, 8, generator=gen, dtype=torch.float64)
    cu_local = torch.tensor(PADDED) // cp
    for rank in range(cp):
        positions = cp_local_positions(PADDED, cp, rank)
        q = torch.randn(positions.numel(), 4, 8, generator=gen, dtype=torch.float64)
        plan = prefix_plan(cu_local, torch.tensor(PADDED), positions, window)
        assert plan.cu_q[-1] == q.shape[0] and plan.cu_k[-1] == plan.k_index.numel()
        assert plan.max_q == int((plan.cu_q[1:] - plan.cu_q[:-1]).max())
        assert plan.max_k == int((plan.cu_k[1:] - plan.cu_k[:-1]).max())
        got, _ = _flash_like(q, keys[plan.k_index], values[plan.k_index], plan.cu_q, plan.cu_k, True, window)
        want = _reference(q, keys, values, cu_local, positions, window)
        torch.testing.assert_close(got, want, atol=TOL["attention_fp64_vs_plain"], rtol=0, msg=f"rank {rank}")


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_flash_block_plans_merged_over_the_ring_equal_plain_softmax(cp):
    """The ring: per source rank, at most two flash calls (the diagonal causal, the rest fully visible) whose
    merged outputs and log-sum-exps give plain softmax attention over every rank's keys."""
    padded = [0, 2 * cp * 2, 2 * cp * 5, 2 * cp * 6]
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(padded[-1], 2, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(padded[-1], 2, 8, generator=gen, dtype=torch.float64)
    cu_local = torch.tensor(padded) // cp
    runs = [position_runs(cu_local, cp_local_positions(padded, cp, r)) for r in range(cp)]
    for rank in range(cp):
        positions = cp_local_positions(padded, cp, rank)
        q = torch.randn(positions.numel(), 4, 8, generator=gen, dtype=torch.float64)
        out = lse = None
        for source in range(cp):
            calls = plan_flash_block(runs[rank], runs[source], q.shape[0])
            assert calls is not None and 1 <= len(calls) <= 2
            assert [c.causal for c in calls].count(True) == (source == rank)
            block_out = torch.zeros(q.shape, dtype=torch.float64)
            block_lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
            index = cp_chunk_index(padded, cp, source)
            for call in calls:
                rows = torch.arange(q.shape[0]) if call.q_index is None else call.q_index
                k, v = keys[index][call.k_index], values[index][call.k_index]
                block_out[rows], block_lse[rows] = _flash_like(q[rows], k, v, call.cu_q, call.cu_k, call.causal)
            out, lse = (block_out, block_lse) if out is None else merge_attention_blocks(out, lse, block_out,
                                                                                         block_lse)
        bounds = cu_local.tolist()
        want = torch.cat([plain_attention(q[qs:qe], keys[ks:ke], values[ks:ke], positions[qs:qe], None, SCALE)
                          for qs, qe, ks, ke in zip(bounds[:-1], bounds[1:], padded[:-1], padded[1:])])
        torch.testing.assert_close(out, want, atol=TOL["attention_fp64_vs_plain"], rtol=0, msg=f"rank {rank}")


def test_flash_block_plan_refuses_runs_that_overlap_off_the_diagonal():
    q_runs = [[(0, 8, 0)]]
    assert plan_flash_block(q_runs, [[(0, 4, 0), (4, 8, 4)]], 8) is None  # keys cut inside the query run
    assert plan_flash_block(q_runs, [[(0, 8, 2)]], 8) is None  # shifted positions
    only_future = plan_flash_block(q_runs, [[(0, 8, 8)]], 8)
    assert only_future == []  # no query sees a key: no call
    with pytest.raises(ValueError, match="segments"):
        plan_flash_block(q_runs, [], 8)
