"""The MoE experts path with quack's fused GEMMs (``kernels.quack.moe``): what runs without a GPU. Its numerics on
quack's kernels are tested on the H200 (``tests/gpu/test_moe_quack_cuda.py``); here, reading the DSL version quack
pins, the refusal without a Hopper GPU, and the arithmetic around quack's GEMMs in fp32 per element against the
experts module's own forward (transformers' eager experts): a stand-in for quack's GEMMs, written from their
documented semantics (``testing.quack_stand_in``: gate and up interleaved along a concatenated operand's non-contiguous dim, the token gather,
variable-length M and K, the dgated epilogue's routing-weight scale and reduction), checks the gathers, the
transposed weight-gradient output, the combine and its backward folded into the down projection's dgrad."""

from __future__ import annotations

import pytest
import torch

import actorcore.kernels.quack.moe as moe_quack
import actorcore.kernels.quack.runtime as quack_runtime
from actorcore.kernels.moe_permute import sort_by_expert
from actorcore.kernels.quack.runtime import _dsl_requirement, quack_refusal
from actorcore.testing.quack_stand_in import QuackStandIn
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL


@pytest.mark.parametrize("requires,want", [
    (["nvidia-cutlass-dsl==4.6.2", "torch", 'nvidia-cutlass-dsl[cu13]==4.6.2; extra == "cu13"'], "==4.6.2"),
    (["torch", "nvidia-cutlass-dsl>=4.7", "apache-tvm-ffi<0.2,>=0.1.6"], ">=4.7"),
    (["nvidia-cutlass-dsl[cu13] ==4.6.2"], "==4.6.2"),
    (["torch", "nvidia-cutlass-dsl-libs-base==4.6.2"], None),
    (['nvidia-cutlass-dsl[cu13]==4.6.2; extra == "cu13"'], None),
])
def test_reads_the_dsl_requirement(requires, want):
    assert _dsl_requirement(requires) == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_refuses_without_a_hopper_gpu():
    assert "Hopper" in quack_refusal()


@pytest.mark.parametrize("per_expert,compiled_passes", [(False, False), (True, False), (True, True)],
                         ids=["stacked", "per_expert", "per_expert_compiled_passes"])
def test_gated_experts_match_the_modules_own_forward_per_element(monkeypatch, per_expert, compiled_passes):
    """Output and the gradients of the inputs, the routing weights and both weights, fp32, against transformers'
    eager experts of a tiny Qwen3-MoE (ties in the routing, an expert without tokens); the weights stacked (the HF
    route) or each expert's a tensor of its own (Megatron's parameters, its experts taking the tokens directly),
    there with the combine and the per-token gradient sum eager or compiled (the Megatron route's compiled layers)."""
    monkeypatch.setattr(quack_runtime, "gemm_interface", lambda: QuackStandIn)
    model = build_tiny_model("qwen3_moe", seed=4)
    model.set_experts_implementation("eager")
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    g = torch.Generator().manual_seed(0)
    tokens, top_k, num_experts = 23, 2, experts.num_experts
    x = torch.randn(tokens, model.config.hidden_size, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(num_experts - 1, generator=g)[:top_k] for _ in range(tokens)])
    index[:3] = index[0].clone()
    weights = torch.rand(tokens, top_k, generator=g, requires_grad=True)
    grad = torch.randn(tokens, model.config.hidden_size, generator=g)
    params = (experts.gate_up_proj, experts.down_proj)

    want = experts(x, index, weights)
    want_grads = torch.autograd.grad(want, (x, weights, *params), grad)
    order = sort_by_expert(index, num_experts)
    cu_seqlens = torch.cat([order.offsets.new_zeros(1), order.offsets])
    index_args = (order.token_of_row.int(), order.pair_of_row, order.row_of_pair, cu_seqlens)
    if per_expert:
        weight_args = [w.detach().clone().requires_grad_() for p in params for w in p.unbind(0)]
        passes = moe_quack.RowPasses()
        if compiled_passes:
            calls = []

            def compiled(fn):
                inner = torch.compile(fn, dynamic=True)
                return lambda *args: calls.append(fn.__name__) or inner(*args)

            passes = moe_quack.RowPasses(compiled(passes.combine), compiled(passes.sum_per_token))
        got = moe_quack._GatedExpertsOfModules.apply(x, weights, *index_args, passes, None, num_experts, *weight_args)
        got_grads = torch.autograd.grad(got, (x, weights, *weight_args), grad)
        got_grads = (*got_grads[:2], torch.stack(got_grads[2:2 + num_experts]),
                     torch.stack(got_grads[2 + num_experts:]))
        if compiled_passes:  # both passes ran through the compiled functions
            assert calls == ["weighted_rows_per_token", "sum_rows_per_token"], calls
    else:
        got = moe_quack._GatedExperts.apply(x, weights, *params, *index_args)
        got_grads = torch.autograd.grad(got, (x, weights, *params), grad)
    tol = TOL["gated_mlp_arithmetic_fp32"]
    assert (want - got).abs().max().item() <= tol * want.abs().max().item()
    for name, w, gg in zip(("x", "weights", "gate_up_proj", "down_proj"), want_grads, got_grads):
        assert w.shape == gg.shape and (w - gg).abs().max().item() <= tol * w.abs().max().item(), name
    assert not got_grads[2][-1].any() and not got_grads[3][-1].any()  # the expert without tokens


def test_gated_expert_rows_match_plain_expert_mlps_per_element(monkeypatch):
    """Rows a token dispatcher sorted by expert (the Megatron route's grouped experts): output and the gradients of the
    rows, the probabilities and both weights, fp32, against plain per-expert SwiGLU MLPs that scale the activation by
    the row's probability before the down projection (Megatron's ``MLP.forward`` with ``per_token_scale``); an
    expert without rows and one with a single row included."""
    monkeypatch.setattr(quack_runtime, "gemm_interface", lambda: QuackStandIn)
    g = torch.Generator().manual_seed(1)
    counts, hidden, inner = [4, 0, 1, 6], 16, 8
    rows = torch.randn(sum(counts), hidden, generator=g, requires_grad=True)
    probs = torch.rand(sum(counts), generator=g, requires_grad=True)
    gate_up = (torch.randn(len(counts), 2 * inner, hidden, generator=g) * 0.3).requires_grad_()
    down = (torch.randn(len(counts), hidden, inner, generator=g) * 0.3).requires_grad_()
    grad = torch.randn(sum(counts), hidden, generator=g)

    def plain(rows, probs, gate_up, down):
        out, start = [], 0
        for expert, count in enumerate(counts):
            pre = rows[start:start + count] @ gate_up[expert].t()
            act = torch.nn.functional.silu(pre[:, :inner]) * pre[:, inner:]
            out.append((act * probs[start:start + count, None]) @ down[expert].t())
            start += count
        return torch.cat(out)

    inputs = (rows, probs, gate_up, down)
    want = plain(*inputs)
    want_grads = torch.autograd.grad(want, inputs, grad)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    cu_seqlens = torch.cat([offsets.new_zeros(1), offsets])
    got = moe_quack._GatedRows.apply(rows, probs, cu_seqlens, 0, gate_up, down)
    got_grads = torch.autograd.grad(got, inputs, grad)
    tol = TOL["gated_mlp_arithmetic_fp32"]
    assert (want - got).abs().max().item() <= tol * want.abs().max().item()
    for name, w, gg in zip(("rows", "probs", "gate_up", "down"), want_grads, got_grads):
        assert w.shape == gg.shape and (w - gg).abs().max().item() <= tol * w.abs().max().item(), name
    assert not bool(got_grads[2][1].any()) and not bool(got_grads[3][1].any())  # the expert without rows
    # each expert's own weights (Megatron's one MLP per expert), scattered in memory: their own gradients
    per_expert = [w.detach()[e].clone().requires_grad_() for w in (gate_up, down) for e in range(len(counts))]
    got = moe_quack._GatedRows.apply(rows, probs, cu_seqlens, len(counts), *per_expert)
    split_grads = torch.autograd.grad(got, per_expert, grad)
    for index, split in enumerate(split_grads):
        assert torch.equal(split, got_grads[2 + index // len(counts)][index % len(counts)]), index
