"""CUDA (Hopper), with quack-kernels installed: the MoE experts path with quack's fused GEMMs
(``patch_model(moe_experts="quack")``, ``kernels.quack.moe``) per element against fp32 math from the same bf16
values, no further from it than the sorted ``grouped_mm`` path; under the compiled decoder the model's log-probs within
bf16 rounding of eager and every parameter's gradient as close to the fp32 model as the grouped path's; the trace
proves the compiled layers ran, the profiler that quack's kernels ran (and none on the grouped path); models whose
experts are not SwiGLU are refused with the reason. Skipped without CUDA or quack."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from support.compiled_decoder_steps import step
from support.moe_experts_cuda import assert_module_runs, assert_no_further_from_fp32, moe_batch, grad_distance, fp32_reference, moe_model, module_runner

import actorcore as ac
from actorcore.testing.tolerances import TOL
from support.moe_quack_cuda import needs_quack, quack_kernels_ran  # noqa: F401 (the autouse skip without quack)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SWIGLU_EXPERTS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")


@pytest.mark.parametrize("hidden,intermediate,tokens", [(64, 40, 301), (512, 256, 2048)])
def test_experts_module_within_bf16_rounding_of_fp32(hidden, intermediate, tokens):
    model = moe_model("qwen3_moe", hidden_size=hidden, moe_intermediate_size=intermediate)
    handle = ac.patch_model(model, moe_experts="quack", compiled_decoder=False)
    module = model.model.get_submodule(handle.state.targets("moe_experts")[0])
    assert module.config._experts_implementation == "actorcore_quack"
    reference = copy.deepcopy(module).float()
    run = module_runner(tokens, hidden, module.num_experts)

    from transformers.integrations.moe import _grouped_mm

    from actorcore.hf.features.moe_experts import sorted_experts_forward

    def grouped(xs, idx, w):
        return sorted_experts_forward(module, xs, idx, w, _grouped_mm, quack=False)

    want = run(reference, type(module).forward.__wrapped__.__get__(reference), torch.float32)  # transformers' eager
    sorted_grouped = run(module, grouped, torch.bfloat16)
    handle.state.trace.counts = Counter()  # as inside an actorcore call
    try:
        fused, ran = quack_kernels_ran(lambda: run(module, module, torch.bfloat16))
        assert ran, "no quack kernel ran"
        again = run(module, module, torch.bfloat16)
    finally:
        handle.state.trace.counts = None
    assert_module_runs(module, want, sorted_grouped, fused, again)
    handle.revert()


@pytest.mark.parametrize("model_type", SWIGLU_EXPERTS)
def test_compiled_decoder_with_quack_experts(model_type):
    pytest.importorskip("triton")
    from actorcore.hf.features.compiled_decoder import COMPILED_TRACE_KEY

    model = moe_model(model_type)
    batch = moe_batch()
    reference = fp32_reference(model, batch)
    handle = ac.patch_model(model, moe_experts=False, compiled_decoder=False)
    eager = step(model, batch, Counter())
    handle.revert()
    distances = {}
    for kernel in ("sorted", "quack"):
        handle = ac.patch_model(model, compiled_decoder=True, moe_experts=kernel, swiglu_mlp=False)
        trace = Counter()
        run, ran = quack_kernels_ran(lambda: step(model, batch, trace))
        assert ran == (kernel == "quack"), (kernel, ran)
        assert trace[COMPILED_TRACE_KEY] == len(handle.state.targets("compiled_decoder")) >= 1
        distances[kernel] = grad_distance(run, reference)
        if kernel == "quack":
            tol = TOL["moe_experts_vs_eager_bf16"]
            assert (eager[0] - run[0]).abs().max().item() < tol and (eager[1] - run[1]).abs().max().item() < tol
            report = ac.verify(model, batch)
            assert report.ok, report
        handle.revert()
    assert_no_further_from_fp32(distances["quack"], distances["sorted"], "the sorted path")


def test_refuses_experts_that_are_not_swiglu():
    model = moe_model("gpt_oss")
    with pytest.raises(ValueError, match="no concatenated|has biases|own gate function"):
        ac.patch_model(model, moe_experts="quack")
