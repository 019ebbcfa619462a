"""CUDA (Hopper), with quack-kernels installed: quack's gated MLP (``patch_model(swiglu_mlp=...)``,
``kernels.quack.gated_mlp``) per element against fp32 math from the same bf16 values, no further from it than the
eager bf16 MLP, bitwise from run to run; under the compiled decoder the model's log-probs within bf16 rounding of eager
and every parameter's gradient as close to the fp32 model as the compiled MLP's, ``verify`` passing; ``"auto"`` takes
it; the trace proves the compiled layers ran, the profiler that quack's kernels ran (none with ``swiglu_mlp=False``).
Skipped without CUDA or quack."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from support.compiled_decoder_steps import step
from support.moe_experts_cuda import assert_no_further_from_fp32, grad_distance
from support.moe_quack_cuda import needs_quack, quack_kernels_ran  # noqa: F401 (the autouse skip without quack)

import actorcore as ac
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model(model_type, **overrides):
    return build_tiny_model(model_type, seed=1, dtype=torch.bfloat16, **overrides).cuda().train()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (37, 301, 5, 190)]).to("cuda")


@pytest.mark.parametrize("hidden,intermediate,tokens", [(64, 88, 301), (512, 1408, 2048)])
def test_mlp_within_bf16_rounding_of_fp32(hidden, intermediate, tokens):
    from actorcore.kernels.quack.gated_mlp import gated_mlp

    mlp = _model("qwen2", hidden_size=hidden, intermediate_size=intermediate).model.layers[0].mlp
    reference = copy.deepcopy(mlp).float()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    grad = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)

    def run(module, forward, dtype):
        xs = x.to(dtype).requires_grad_()
        out = forward(module, xs)
        params = (module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)
        grads = torch.autograd.grad(out, (xs, *params), grad.to(dtype))
        return [t.float() for t in (out, *grads)]

    def quack(module, xs):
        return gated_mlp(xs, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)

    want = run(reference, lambda m, xs: m(xs), torch.float32)
    eager = run(mlp, lambda m, xs: m(xs), torch.bfloat16)
    path, ran = quack_kernels_ran(lambda: run(mlp, quack, torch.bfloat16))
    assert ran, "no quack kernel ran"
    again = run(mlp, quack, torch.bfloat16)
    for w, e, p, a in zip(want, eager, path, again):
        scale = w.abs().max().item()
        assert torch.equal(p, a)
        assert (w - p).abs().max().item() <= TOL["gated_mlp_quack_vs_fp32_bf16_rel"] * scale
        assert (w - p).norm().item() <= 1.5 * (w - e).norm().item() + 1e-6 * scale


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen2_moe", "deepseek_v3"])
def test_compiled_decoder_with_quack_mlp(model_type):
    pytest.importorskip("triton")
    from actorcore.hf.features.compiled_decoder import COMPILED_TRACE_KEY

    model = _model(model_type)
    batch = _batch()
    reference = copy.deepcopy(model).float()
    handle = ac.patch_model(reference, compiled_decoder=False, moe_experts=False, swiglu_mlp=False)
    want = step(reference, batch, Counter())
    handle.revert()
    handle = ac.patch_model(model, compiled_decoder=False, swiglu_mlp=False)
    eager = step(model, batch, Counter())
    handle.revert()
    distances = {}
    for request in (False, "auto"):
        handle = ac.patch_model(model, compiled_decoder=True, swiglu_mlp=request)
        assert bool(handle.state.targets("swiglu_mlp")) == (request == "auto")
        trace = Counter()
        run, ran = quack_kernels_ran(lambda: step(model, batch, trace))
        assert trace[COMPILED_TRACE_KEY] == len(handle.state.targets("compiled_decoder")) >= 1
        distances[request] = grad_distance(run, want)
        if request == "auto":
            assert ran, "no quack kernel ran"
            tol = TOL["compiled_decoder_vs_eager_bf16"]
            assert (eager[0] - run[0]).abs().max().item() < tol and (eager[1] - run[1]).abs().max().item() < tol
            report = ac.verify(model, batch)
            assert report.ok, report
        elif model_type in ("llama", "qwen3"):  # no MoE experts that could run quack's kernels
            assert not ran
        handle.revert()
    assert_no_further_from_fp32(distances["auto"], distances[False], "the compiled MLP")
