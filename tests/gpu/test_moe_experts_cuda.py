"""CUDA: the MoE experts path (``patch_model(moe_experts=...)``, grouped GEMMs over tokens moved with gathers only)
against the same bf16 model on transformers' own eager experts, per element: one experts module's output and
gradients within bf16 rounding of fp32 math from the same bf16 values, and no further from it than the eager bf16
experts; the whole model's log-probs, entropies and parameter gradients with the eager decoder; under the fused
decoder (where ``"auto"``, the default, installs it: asserted here) the log-probs and entropies within bf16 rounding
of eager, and every parameter's gradient as close to the fp32 model's as transformers' own ``grouped_mm`` experts
under the same compiled decoder are (the yardstick: on two of the tiny models the bf16 eager model itself is 11-21% of
a gradient's norm from fp32, so bf16 paths are compared by their distance to fp32, not to each other); two runs are
bitwise equal (the experts module's outputs and gradients, the model's log-probs); the trace proves it ran in every
MoE layer; ``verify`` still passes.
Skipped without CUDA."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from support.compiled_decoder_steps import step

import actorcore as ac
from actorcore.testing.tolerances import TOL
from support.moe_experts_cuda import assert_module_runs, assert_no_further_from_fp32, moe_batch, grad_distance, fp32_reference, moe_model, module_runner


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

COVERED = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v3", "qwen3_next",
           "qwen3_5_moe_text")


def _compare(eager, path):
    (lp_e, ent_e, g_e), (lp_p, ent_p, g_p) = eager, path
    tol = TOL["moe_experts_vs_eager_bf16"]
    assert (lp_e - lp_p).abs().max().item() < tol and (ent_e - ent_p).abs().max().item() < tol
    assert g_e.keys() == g_p.keys()
    rel = TOL["grad_moe_experts_vs_eager_bf16_rel_norm"]
    for name in g_e:
        assert (g_e[name] - g_p[name]).norm().item() <= rel * g_e[name].norm().item() + 1e-6, name


@pytest.mark.parametrize("model_type", COVERED)
def test_experts_module_within_bf16_rounding_of_eager(model_type):
    model = moe_model(model_type)
    handle = ac.patch_model(model, moe_experts="sorted", compiled_decoder=False)
    experts = model.model.get_submodule(handle.state.targets("moe_experts")[0])
    from actorcore.hf.features.class_paths import TRACE_ATTR
    from actorcore.hf.features.moe_experts import MOE_EXPERTS_KEY

    reference = copy.deepcopy(experts).float()  # fp32 math from the same bf16 values: the yardstick
    reference.__dict__.pop(TRACE_ATTR)
    eager_forward = type(experts).forward.__wrapped__  # transformers' eager experts forward (the class's own)
    run = module_runner(301, model.config.hidden_size, experts.num_experts)
    want = run(reference, eager_forward.__get__(reference), torch.float32)
    eager = run(experts, eager_forward.__get__(experts), torch.bfloat16)
    handle.state.trace.counts = Counter()  # as inside an actorcore call
    try:
        path = run(experts, experts, torch.bfloat16)
        assert handle.state.trace.counts[MOE_EXPERTS_KEY] == 1
        again = run(experts, experts, torch.bfloat16)
    finally:
        handle.state.trace.counts = None
    assert_module_runs(experts, want, eager, path, again)
    handle.revert()


@pytest.mark.parametrize("model_type", COVERED)
@pytest.mark.parametrize("fused", [False, True])
def test_model_matches_eager_experts_and_ran(model_type, fused):
    if fused:
        pytest.importorskip("triton")
    from torch._dynamo.utils import guard_failures

    from actorcore.archs import get_spec
    from actorcore.hf.features.compiled_decoder import COMPILED_TRACE_KEY
    from actorcore.hf.features.moe_experts import MOE_EXPERTS_KEY

    # The tiny Qwen3-Next's one MoE block sits in its linear-attention layer, which stays eager: here it moves to the
    # full-attention layer, so that a compiled layer holds experts (Qwen3.5-MoE keeps MoE in an eager layer).
    model = moe_model(model_type, **(dict(mlp_only_layers=[0]) if model_type == "qwen3_next" else {}))
    batch = moe_batch()
    handle = ac.patch_model(model, moe_experts=False, compiled_decoder=False)  # eager decoder, eager experts
    eager = step(model, batch, Counter())
    handle.revert()
    handle = ac.patch_model(model, compiled_decoder=fused)  # "auto", the default: the path where the decoder is compiled
    refused = get_spec(model_type).linear_attention is not None  # hybrids keep their own experts under "auto"
    assert bool(handle.state.targets("moe_experts")) == (fused and not refused)
    handle.revert()
    handle = ac.patch_model(model, compiled_decoder=fused, moe_experts="sorted")
    modules = len(handle.state.targets("moe_experts"))
    assert modules >= 1
    trace = Counter()
    path = step(model, batch, trace)
    if fused:  # compiled layers take the path by construction, with one compilation for every layer
        from actorcore.hf.features.class_paths import names_inside as _names_inside

        compiled = _names_inside(handle.parts.decoder, [handle.parts.layers[i] for i in handle.state.targets("compiled_decoder")],
                                 handle.state.targets("moe_experts"))
        assert compiled and trace[COMPILED_TRACE_KEY] == len(handle.state.targets("compiled_decoder"))
        assert trace[MOE_EXPERTS_KEY] == modules - len(compiled)  # the hybrids' linear-attention layers stay eager
        assert not [r for reasons in guard_failures.values() for r in reasons if "experts" in str(r)], guard_failures
    else:
        assert trace[MOE_EXPERTS_KEY] == modules
    if fused:  # log-probs and entropies within bf16 rounding; the gradients: test_fused_path_as_close_to_fp32_...
        tol = TOL["moe_experts_vs_eager_bf16"]
        assert (eager[0] - path[0]).abs().max().item() < tol and (eager[1] - path[1]).abs().max().item() < tol
    else:
        _compare(eager, path)
    again = step(model, batch, Counter())  # forward bitwise (flash attention's backward accumulates with atomics)
    for a, b in zip(path[:2], again[:2]):
        assert torch.equal(a, b), "two runs differ"
    report = ac.verify(model, batch)  # the model's own forward keeps its own experts code
    assert report.ok, report
    handle.revert()


def _path_and_transformers_distances(model_type, seed=1, kernel="sorted"):
    model = moe_model(model_type, seed=seed)
    batch = moe_batch()
    reference = fp32_reference(model, batch)
    model.set_experts_implementation("grouped_mm")
    distances = {}
    for experts in (False, kernel):
        handle = ac.patch_model(model, compiled_decoder=True, moe_experts=experts)
        assert bool(handle.state.targets("moe_experts")) == (experts == kernel)
        distances[experts] = grad_distance(step(model, batch, Counter()), reference)
        handle.revert()
    return distances[kernel], distances[False]


@pytest.mark.parametrize("model_type", [m for m in COVERED if m != "qwen3_next"])
def test_fused_path_as_close_to_fp32_as_transformers_experts(model_type):
    """Under the compiled decoder, the path against transformers' own ``grouped_mm`` experts under the same fused
    decoder, both measured by their distance to the fp32 model (same values, eager): per token in log-probs and per
    parameter in gradients the path is no further from fp32 than transformers' experts, up to the table's factor
    and floor."""
    pytest.importorskip("triton")
    path, transformers_experts = _path_and_transformers_distances(model_type)
    assert_no_further_from_fp32(path, transformers_experts, "transformers' experts")


@pytest.mark.parametrize("kernel", ["sorted", "quack"])
def test_linear_attention_models_as_close_to_fp32_on_four_seeds(kernel):
    """Why ``moe_experts="auto"`` treats models with linear-attention layers as any MoE model: on the tiny Qwen3-Next
    under the compiled decoder, over four seeds, the path's gradients (the Gated DeltaNet decay parameters' included)
    are no further from fp32 than transformers' experts, on the sorted kernel (four of four on the H200, 2026-12-07)
    and on quack's GEMMs (four of four on the H100, 2026-12-07)."""
    pytest.importorskip("triton")
    if kernel == "quack":
        pytest.importorskip("quack")
    for seed in (1, 2, 3, 4):
        path, transformers_experts = _path_and_transformers_distances("qwen3_next", seed, kernel)
        assert_no_further_from_fp32(path, transformers_experts, f"transformers' experts (seed {seed})")


