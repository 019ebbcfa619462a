"""Ring attention's per-block kernel (``actorcore.kernels.attention.block_attention``): merging the blocks of every CP rank
(each rank's keys at their positions in the load-balanced layout) gives plain float64 softmax attention for every
rank's queries, per element, and the blocks' flash-style backward gives autograd's gradients of that softmax."""

from __future__ import annotations


import pytest
import torch

from actorcore.context_split import cp_chunk_index, cp_local_positions
from actorcore.kernels.attention.block_attention import (attention_block_backward, attention_block_forward,
                                               merge_attention_blocks, position_runs)
from actorcore.testing.tolerances import TOL
from support.attention_reference import plain_attention


PADDED = [0, 8, 24, 32]  # three segments of a cp=2 or cp=4 layout (multiples of 2*cp = 8)


@pytest.mark.parametrize("cp,window,max_run", [(2, None, None), (2, None, 3), (4, 5, None)])
def test_merged_blocks_equal_plain_softmax_and_its_gradients(cp, window, max_run):
    gen = torch.Generator().manual_seed(7)
    scale = 0.3
    keys = torch.randn(PADDED[-1], 2, 16, generator=gen, dtype=torch.float64)
    values = torch.randn(PADDED[-1], 2, 12, generator=gen, dtype=torch.float64)  # value head dim differs (MLA)
    cu_local = torch.tensor(PADDED) // cp
    index = [cp_chunk_index(PADDED, cp, r) for r in range(cp)]
    runs = [position_runs(cu_local, cp_local_positions(PADDED, cp, r), max_run) for r in range(cp)]
    assert max_run is None or max(b - a for segment in runs[0] for a, b, _ in segment) == max_run  # tiles cut
    tol = TOL["cp_attention_vs_reference_fp32"]
    for rank in range(cp):
        positions = cp_local_positions(PADDED, cp, rank)
        q = torch.randn(positions.numel(), 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
        k, v = keys.clone().requires_grad_(), values.clone().requires_grad_()
        grad = torch.randn(positions.numel(), 4, 12, generator=gen, dtype=torch.float64)
        # Reference: plain softmax per segment over the whole segment's keys, and autograd.
        bounds = cu_local.tolist()
        ref = torch.cat([plain_attention(q[qs:qe], k[ks:ke], v[ks:ke], positions[qs:qe], window, scale)
                         for qs, qe, ks, ke in zip(bounds[:-1], bounds[1:], PADDED[:-1], PADDED[1:])])
        ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (q, k, v), grad)
        # Blocks: rank ``source`` holds keys[index[source]]; merged in ring order starting with this rank's own.
        out = lse = None
        for step in range(cp):
            source = (rank - step) % cp
            block = attention_block_forward(q.detach(), keys[index[source]], values[index[source]], runs[rank],
                                            runs[source], scale=scale, sliding_window=window)
            assert block[0].dtype == torch.float32 and block[1].dtype == torch.float32
            out, lse = block if out is None else merge_attention_blocks(out, lse, *block)
        torch.testing.assert_close(out.double(), ref.detach(), atol=tol, rtol=0, msg=f"rank {rank}")
        delta = (grad.float() * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(keys), torch.zeros_like(values)
        for source in range(cp):
            block_dq, block_dk, block_dv = attention_block_backward(
                grad, q.detach(), keys[index[source]], values[index[source]], lse, delta, runs[rank], runs[source],
                scale=scale, sliding_window=window)
            dq += block_dq
            dk[index[source]] += block_dk.double()
            dv[index[source]] += block_dv.double()
        for name, got, want in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
            torch.testing.assert_close(got, want, atol=tol * want.abs().max(), rtol=0, msg=f"rank {rank} {name}")


def test_a_block_entirely_in_the_future_contributes_nothing():
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    q_runs, k_runs = [[(0, 4, 0)]], [[(0, 4, 4)]]  # queries at positions 0-3, keys at 4-7
    out, lse = attention_block_forward(q, k, v, q_runs, k_runs, scale=0.5)
    assert torch.equal(out, torch.zeros(4, 2, 8)) and bool(torch.isneginf(lse).all())
    own = attention_block_forward(q, k, v, q_runs, [[(0, 4, 0)]], scale=0.5)
    merged = merge_attention_blocks(*own, out, lse)
    assert torch.equal(merged[0], own[0]) and torch.equal(merged[1], own[1])
    dq, dk, dv = attention_block_backward(torch.randn(4, 2, 8), q, k, v, own[1], torch.randn(4, 2), q_runs, k_runs,
                                          scale=0.5)
    assert not dq.any() and not dk.any() and not dv.any()


def test_position_runs_split_at_gaps():
    runs = position_runs(torch.tensor([0, 4, 6]), torch.tensor([0, 1, 6, 7, 3, 4]))
    assert runs == [[(0, 2, 0), (2, 4, 6)], [(4, 6, 3)]]
    tiles = position_runs(torch.tensor([0, 5]), torch.tensor([0, 1, 2, 3, 4]), max_run=2)
    assert tiles == [[(0, 2, 0), (2, 4, 2), (4, 5, 4)]]
    with pytest.raises(ValueError, match="positions but the segments end"):
        position_runs(torch.tensor([0, 5]), torch.tensor([0, 1]))
