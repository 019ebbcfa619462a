"""Grouped GEMMs over rows sorted by expert (``kernels.grouped_gemm``): torch's ``grouped_mm`` and the one-GEMM-per-
expert fallback, each per element against a plain per-expert matmul in float64 (forward, input and weight
gradients), with empty groups, groups of one row, no rows at all, and an expanded output gradient (``sum()``), which
torch's own ``grouped_mm`` backward refuses."""

from __future__ import annotations

import pytest
import torch

from actorcore.kernels import grouped_gemm
from actorcore.testing.tolerances import TOL

COUNTS = ([3, 0, 5, 1], [0, 0, 9, 0], [1, 1, 1, 1], [0, 0, 0, 0])


def _reference(x, weight, counts):
    """Each group's rows times its weight's transpose, float64."""
    rows, start = [], 0
    for expert, count in enumerate(counts):
        rows.append(x[start:start + count].double() @ weight[expert].double().t())
        start += count
    return torch.cat(rows)


@pytest.mark.parametrize("use_torch", [True, False], ids=["grouped_mm", "per_expert"])
@pytest.mark.parametrize("counts", COUNTS, ids=lambda c: "-".join(map(str, c)))
def test_grouped_linear_matches_per_expert_matmuls(use_torch, counts):
    gen = torch.Generator().manual_seed(sum(counts) + 3)
    x = torch.randn(sum(counts), 16, generator=gen, requires_grad=True)
    weight = torch.randn(len(counts), 24, 16, generator=gen, requires_grad=True)
    offsets = grouped_gemm.group_offsets(counts, x.device)
    assert offsets.dtype == torch.int32 and offsets.tolist() == torch.tensor(counts).cumsum(0).tolist()
    assert grouped_gemm.grouped_mm_refusal(x, weight) is None  # torch 2.13's CPU kernel takes these
    got = grouped_gemm._GroupedLinear.apply(x, offsets, use_torch, weight)
    got.sum().backward()  # an expanded gradient
    ref_x, ref_w = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = _reference(ref_x, ref_w, counts)
    want.sum().backward()
    tol = TOL["kernel_chunked_vs_reference_fp32"]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, atol=tol, rtol=0)
    torch.testing.assert_close(weight.grad.double(), ref_w.grad, atol=tol, rtol=0)
    if counts[1] == 0 and sum(counts):
        assert not bool(weight.grad[1].any())  # an empty group's weight gets no gradient


def test_refusals_say_why():
    x = torch.randn(4, 6)  # 24-byte rows: not a multiple of 16 bytes
    assert "16-byte" in grouped_gemm.grouped_mm_refusal(x, torch.randn(2, 8, 6))
    assert "dtype" in grouped_gemm.grouped_mm_refusal(x.double(), torch.randn(2, 8, 6).double())
    with pytest.raises(ValueError, match="one end row per expert"):
        grouped_gemm.grouped_linear(torch.randn(4, 8), torch.randn(2, 8, 8), torch.tensor([4]))


def test_unaligned_widths_take_the_per_expert_fallback():
    """Widths torch's kernel refuses still multiply right (the fallback), bf16 too."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 6, generator=gen, dtype=torch.bfloat16)
    weight = torch.randn(3, 5, 6, generator=gen, dtype=torch.bfloat16)
    got = grouped_gemm.grouped_linear(x, weight, grouped_gemm.group_offsets([2, 0, 5], x.device))
    want = _reference(x, weight, [2, 0, 5])
    assert (got.double() - want).abs().max() <= TOL["grouped_gemm_bf16_vs_fp64_rel"] * want.abs().max()


@pytest.mark.parametrize("in_place", [True, False], ids=["consecutive", "scattered"])
def test_per_expert_weights_stack_in_place_and_get_their_own_gradients(in_place):
    """Each expert's own weight tensor: read in place where they are consecutive slices of one storage (a view, no
    copy), stacked otherwise; each gets its own gradient, equal to the stacked weight's slice."""
    gen = torch.Generator().manual_seed(5)
    counts = [2, 0, 3]
    base = torch.randn(3, 8, 16, generator=gen)
    weights = [torch.nn.Parameter(base[e] if in_place else base[e].clone()) for e in range(3)]
    assert grouped_gemm.consecutive(weights) == in_place
    stacked = grouped_gemm.stack_experts(weights)
    assert (stacked.data_ptr() == base.data_ptr()) == in_place and torch.equal(stacked, base)
    x = torch.randn(5, 16, generator=gen)
    grad = torch.randn(5, 8, generator=gen)
    offsets = grouped_gemm.group_offsets(counts, x.device)
    grouped_gemm.grouped_linear(x, weights, offsets).backward(grad)
    whole = base.clone().requires_grad_()
    grouped_gemm.grouped_linear(x, whole, offsets).backward(grad)
    for expert, weight in enumerate(weights):
        assert torch.equal(weight.grad, whole.grad[expert]), expert
