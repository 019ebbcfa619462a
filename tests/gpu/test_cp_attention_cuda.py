"""CUDA: context parallelism's flash paths on bf16 inputs equal the plain fp32 paths on the same inputs, per
element, and prove they ran: the all-gather path's one varlen call over every query run's key prefix
(``causal_attention_at_positions``), and the ring's per-block flash calls merged over every source rank
(``flash_blocks``), forward and backward. Skipped without CUDA."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from actorcore.testing.tolerances import TOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LENGTHS = [8, 600, 2048, 72]  # each padded to a multiple of 2*cp below


def _layout(cp):
    from actorcore.context_split import cp_padded_bounds

    return cp_padded_bounds([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], cp)


def _tensors(rows, heads, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)


def _assert_close(got, want, what):
    assert (got.float() - want).abs().max().item() < TOL["cp_flash_bf16_vs_fp32"], what


def _assert_grads_close(got, want, what):
    for name, a, b in zip("q k v".split(), got, want):
        rel = ((a.float() - b).norm() / b.norm()).item()
        assert rel < TOL["grad_cp_flash_bf16_vs_fp32_rel_norm"], f"{what} d{name}: {rel}"


@pytest.mark.parametrize("cp,window", [(2, None), (4, None), (2, 300)])
def test_all_gather_varlen_path_equals_segments(cp, window):
    from actorcore.context_split import cp_local_positions
    from actorcore.kernels.attention.varlen import causal_attention_at_positions, choose_backend

    padded = _layout(cp)
    backend = choose_backend(torch.device("cuda"), torch.bfloat16, None, 0.0)
    if backend == "segments":
        pytest.skip("no flash kernel in this torch")
    keys, values = _tensors(padded[-1], 2, 1), _tensors(padded[-1], 2, 2)
    for rank in range(cp):
        positions = cp_local_positions(padded, cp, rank)
        q = _tensors(positions.numel(), 8, 10 + rank)
        cu_q, cu_k = torch.tensor(padded) // cp, torch.tensor(padded)
        inputs = [x.clone().requires_grad_() for x in (q, keys, values)]
        trace = Counter()
        fast = causal_attention_at_positions(*inputs, cu_q, cu_k, positions, scale=0.1, sliding_window=window,
                                             trace=trace)
        assert trace == {f"varlen_attention:at_positions:{backend}": 1}
        ref_inputs = [x.float().requires_grad_() for x in (q, keys, values)]
        ref = causal_attention_at_positions(*ref_inputs, cu_q, cu_k, positions, scale=0.1, sliding_window=window,
                                            backend="segments")
        _assert_close(fast, ref, f"rank {rank} output")
        grad = torch.randn_like(ref)
        got = torch.autograd.grad(fast, inputs, grad.to(fast.dtype))
        want = torch.autograd.grad(ref, ref_inputs, grad)
        _assert_grads_close(got, want, f"rank {rank}")


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_flash_blocks_equal_plain_blocks(cp):
    """Every rank's blocks against every source, merged as the ring merges them: flash (bf16) vs the plain fp32
    block kernel on the same values, outputs and the backward's dq, dk, dv."""
    from actorcore.context_split import cp_chunk_index, cp_local_positions
    from actorcore.kernels.attention.block_attention import (attention_block_backward, attention_block_forward,
                                                   merge_attention_blocks, position_runs)
    from actorcore.kernels.attention.flash_blocks import flash_block_backward, flash_block_forward, plan_flash_block

    padded = _layout(cp)
    cu_local = torch.tensor(padded) // cp
    runs = [position_runs(cu_local, cp_local_positions(padded, cp, r)) for r in range(cp)]
    keys, values = _tensors(padded[-1], 2, 3), _tensors(padded[-1], 2, 4)
    index = [cp_chunk_index(padded, cp, r).cuda() for r in range(cp)]
    for rank in range(cp):
        q = _tensors(index[rank].numel(), 8, 20 + rank)
        plans = [[c.to(q.device) for c in plan_flash_block(runs[rank], runs[s], q.shape[0])] for s in range(cp)]
        flash, plain = None, None
        for source in range(cp):
            k, v = keys[index[source]], values[index[source]]
            block = flash_block_forward(q, k, v, plans[source], scale=0.1)
            flash = block if flash is None else merge_attention_blocks(*flash, *block)
            block = attention_block_forward(q.float(), k.float(), v.float(), runs[rank], runs[source], scale=0.1)
            plain = block if plain is None else merge_attention_blocks(*plain, *block)
        _assert_close(flash[0], plain[0], f"rank {rank} output")
        assert (flash[1] - plain[1]).abs().max().item() < TOL["cp_flash_bf16_vs_fp32"], f"rank {rank} lse"
        grad = torch.randn_like(plain[0])
        delta = (grad * plain[0]).sum(-1)
        got = [torch.zeros(x.shape, device="cuda") for x in (q, keys, values)]
        want = [torch.zeros(x.shape, device="cuda") for x in (q, keys, values)]
        for source in range(cp):
            k, v = keys[index[source]], values[index[source]]
            dq, dk, dv = flash_block_backward(grad, q, k, v, flash[0], flash[1], plans[source], scale=0.1)
            got[0] += dq
            got[1][index[source]] += dk
            got[2][index[source]] += dv
            dq, dk, dv = attention_block_backward(grad, q.float(), k.float(), v.float(), plain[1], delta, runs[rank],
                                                  runs[source], scale=0.1)
            want[0] += dq
            want[1][index[source]] += dk
            want[2][index[source]] += dv
        _assert_grads_close(got, want, f"rank {rank}")
