"""An op that keeps its norm's input instead of the norm's output (``kernels.recomputed_input``): the Megatron
route's QKV projection (``mcore/build/normed_projection.py``) and quack's gated MLP (``kernels.quack.gated_mlp``,
quack's GEMMs as the CPU stand-in). Each against the op keeping its input: the output and every gradient (the
source's, the norm's weight, the projection's) bitwise equal, and the norm's output no longer among the saved
tensors. A lent input the projection was not handed (a copy) runs Megatron's code."""

from __future__ import annotations

import functools

import pytest
import torch

from actorcore.kernels.recomputed_input import RecomputedInput

pytest.importorskip("megatron.core")

T, D, OUT = 37, 24, 40
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


def _norm(dtype: torch.dtype, device: str = "cpu") -> torch.nn.RMSNorm:
    norm = torch.nn.RMSNorm(D, eps=1e-5, dtype=dtype, device=device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=torch.Generator().manual_seed(3)) + 0.5)
    return norm


def _inputs(dtype: torch.dtype, seed: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    source = torch.randn(T, 1, D, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(OUT, D, generator=gen) / D**0.5).to(device, dtype).requires_grad_()
    bias = torch.randn(OUT, generator=gen).to(device, dtype).requires_grad_()
    return source, weight, bias


def _run(step, tensors, norm):
    """``step``'s output, the gradients of ``tensors`` and the norm's weight, and the storages it saved."""
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    for t in (*tensors, norm.weight):
        t.grad = None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, normed = step()
    out.backward(grad_of(out))
    return out.detach(), [t.grad.clone() for t in (*tensors, norm.weight)], saved, normed.untyped_storage().data_ptr()


def grad_of(out: torch.Tensor) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_projection_keeping_the_norms_input_has_megatrons_gradients_bitwise(dtype, compiled, device):
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    from actorcore.mcore.build.fused_ops import apply_norm
    from actorcore.mcore.build.fused_ops import compiled as compile_fn
    from actorcore.mcore.build.normed_projection import _ProjectRecomputedInput

    norm = _norm(dtype, device)
    fn = functools.partial(compile_fn(apply_norm) if compiled else apply_norm, norm)
    source, weight, bias = _inputs(dtype, 1, device)

    def megatrons():
        normed = fn(source)
        return linear_with_grad_accumulation_and_async_allreduce(normed, weight, bias, False, False, False), normed

    def recomputing():
        normed = fn(source)
        return _ProjectRecomputedInput.apply(normed, RecomputedInput(source, fn), weight, bias), normed

    want, want_grads, want_saved, want_normed = _run(megatrons, (source, weight, bias), norm)
    got, got_grads, got_saved, got_normed = _run(recomputing, (source, weight, bias), norm)
    assert torch.equal(got, want)
    for name, a, b in zip(("source", "weight", "bias", "norm weight"), got_grads, want_grads):
        assert torch.equal(a, b), name
    assert want_normed in want_saved and got_normed not in got_saved  # Megatron's keeps the norm's output, this not
    assert source.untyped_storage().data_ptr() in got_saved


def test_a_projection_lent_another_tensor_runs_megatrons_code():
    """Only the very norm output the layer lent (the same memory, view and version) is recomputed: a copy of it, or
    the lent tensor written to after lending, keeps its input as Megatron does."""
    from actorcore.mcore.build.normed_projection import NormRecomputingLinear

    linear = NormRecomputingLinear.__new__(NormRecomputingLinear)
    torch.nn.Module.__init__(linear)
    norm = _norm(torch.float32)
    source, weight, _ = _inputs(torch.float32, 2)
    normed = norm(source)
    origin = RecomputedInput(source, norm)
    for handed, recomputed in ((normed, True), (normed.clone(), False), (normed.view(T, D), False)):
        calls = linear.recomputing_calls
        with linear.normed_from(normed, origin):
            linear._forward_impl(handed, weight, None, False, False, False, None, None, None)
        assert (linear.recomputing_calls > calls) == recomputed
    for unchanged_only in (False, True):
        lent = norm(source).detach().requires_grad_()
        with linear.normed_from(lent, origin):
            calls = linear.recomputing_calls
            if unchanged_only:
                with torch.no_grad():
                    lent.mul_(1.0)  # a new version of the lent tensor
            linear._forward_impl(lent, weight, None, False, False, False, None, None, None)
        assert (linear.recomputing_calls > calls) == (not unchanged_only)
    assert "_lent" not in linear.__dict__  # the loan ends with the block


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True])
def test_quack_gated_mlp_keeping_the_norms_input_has_the_same_gradients_bitwise(compiled, device):
    """quack's GEMMs as the stand-in on the CPU, quack's own on CUDA (skipped where quack does not run)."""
    from actorcore.kernels.quack import gated_mlp as quack_gated_mlp
    from actorcore.kernels.quack.runtime import quack_refusal
    from actorcore.mcore.build.fused_ops import apply_norm
    from actorcore.mcore.build.fused_ops import compiled as compile_fn
    from actorcore.testing.quack_stand_in import use_quack_stand_in

    if device == "cuda" and quack_refusal() is not None:
        pytest.skip(quack_refusal())
    undo = use_quack_stand_in() if device == "cpu" else (lambda: None)
    try:
        dtype = torch.bfloat16
        norm = _norm(dtype, device)
        fn = functools.partial(compile_fn(apply_norm) if compiled else apply_norm, norm)
        source, _, _ = _inputs(dtype, 4, device)
        gen = torch.Generator().manual_seed(5)
        gate, up = ((torch.randn(OUT, D, generator=gen) / D**0.5).to(device, dtype).requires_grad_() for _ in range(2))
        down = (torch.randn(D, OUT, generator=gen) / OUT**0.5).to(device, dtype).requires_grad_()

        def step(keep_source):
            def run():
                normed = fn(source)
                x_from = RecomputedInput(source, fn) if keep_source else None
                return quack_gated_mlp.gated_mlp(normed.view(T, D), gate, up, down, x_from), normed
            return run

        want, want_grads, want_saved, want_normed = _run(step(False), (source, gate, up, down), norm)
        got, got_grads, got_saved, got_normed = _run(step(True), (source, gate, up, down), norm)
        assert torch.equal(got, want)
        for name, a, b in zip(("source", "gate", "up", "down", "norm weight"), got_grads, want_grads):
            assert torch.equal(a, b), name
        assert want_normed in want_saved and got_normed not in got_saved
    finally:
        undo()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_router_gating_keeping_the_norms_input_has_megatrons_gradients_bitwise(with_bias, device):
    """bf16 tokens, the router's GEMM in fp32 (``moe_router_dtype="fp32"``), against megatron-core's
    ``RouterGatingLinearFunction`` (its path without Transformer Engine)."""
    from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction

    from actorcore.mcore.build.fused_ops import apply_norm
    from actorcore.mcore.build.fused_ops import compiled as compile_fn
    from actorcore.mcore.build.normed_projection import _GateRecomputedInput
    from actorcore.mcore.cpu_runtime import te_absent_fixes

    norm = _norm(torch.bfloat16, device)
    fn = functools.partial(compile_fn(apply_norm), norm)
    source, weight, bias = _inputs(torch.bfloat16, 6, device)
    bias = bias if with_bias else None
    tensors = (source, weight) + ((bias,) if with_bias else ())

    def megatrons():
        normed = fn(source)
        return RouterGatingLinearFunction.apply(normed, weight, bias, torch.float32), normed

    def recomputing():
        normed = fn(source)
        return _GateRecomputedInput.apply(normed, RecomputedInput(source, fn), weight, bias, torch.float32), normed

    with te_absent_fixes():  # megatron-core's router without Transformer Engine
        want, want_grads, want_saved, want_normed = _run(megatrons, tensors, norm)
    got, got_grads, got_saved, got_normed = _run(recomputing, tensors, norm)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)
    assert want_normed in want_saved and got_normed not in got_saved


@pytest.mark.parametrize("device", DEVICES)
def test_quack_local_experts_keeping_the_norms_input_have_the_same_gradients_bitwise(device):
    """``kernels.quack.moe.gated_experts`` with per-expert weights (the Megatron route's local experts): quack's
    GEMMs as the stand-in on the CPU, quack's own on CUDA."""
    from actorcore.kernels.moe_permute import sort_by_expert
    from actorcore.kernels.quack.moe import gated_experts
    from actorcore.kernels.quack.runtime import quack_refusal
    from actorcore.mcore.build.fused_ops import apply_norm
    from actorcore.mcore.build.fused_ops import compiled as compile_fn
    from actorcore.testing.quack_stand_in import use_quack_stand_in

    if device == "cuda" and quack_refusal() is not None:
        pytest.skip(quack_refusal())
    undo = use_quack_stand_in() if device == "cpu" else (lambda: None)
    try:
        dtype, experts, top_k, inner = torch.bfloat16, 4, 2, 16
        norm = _norm(dtype, device)
        fn = functools.partial(compile_fn(apply_norm), norm)
        source, _, _ = _inputs(dtype, 8, device)
        gen = torch.Generator().manual_seed(9)
        gate_up = [(torch.randn(2 * inner, D, generator=gen) / D**0.5).to(device, dtype).requires_grad_()
                   for _ in range(experts)]
        down = [(torch.randn(D, inner, generator=gen) / inner**0.5).to(device, dtype).requires_grad_()
                for _ in range(experts)]
        chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(T)]).to(device)
        chosen[:, 0] = 1  # expert 1 takes every token, expert 3 maybe none
        chosen[:, 1] = torch.where(chosen[:, 1] == 1, 0, chosen[:, 1])
        weights = torch.rand(T, top_k, generator=gen).to(device).requires_grad_()
        order = sort_by_expert(chosen, experts)

        def step(keep_source):
            def run():
                normed = fn(source)
                x_from = RecomputedInput(source, fn) if keep_source else None
                return gated_experts(normed.view(T, D), weights, gate_up, down, order, None, x_from), normed
            return run

        tensors = (source, weights, *gate_up, *down)
        want, want_grads, want_saved, want_normed = _run(step(False), tensors, norm)
        got, got_grads, got_saved, got_normed = _run(step(True), tensors, norm)
        assert torch.equal(got, want)
        for a, b in zip(got_grads, want_grads):
            assert torch.equal(a, b)
        assert want_normed in want_saved and got_normed not in got_saved
    finally:
        undo()
