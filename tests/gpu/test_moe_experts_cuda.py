"""CUDA: the MoE experts path (``patch_model(moe_experts=...)``, grouped GEMMs over tokens moved with gathers only)
against the same bf16 model on transformers' own eager experts, per element: one experts module's output and
gradients within bf16 rounding of fp32 math from the same bf16 values, and no further from it than the eager bf16
experts; the whole model's log-probs, entropies and parameter gradients with the eager decoder; under the fused
decoder (where ``"auto"``, the default, installs it: asserted here) the log-probs and entropies within bf16 rounding
of eager, and every parameter's gradient as close to the fp32 model's as transformers' own ``grouped_mm`` experts
under the same fused decoder are (the yardstick: on two of the tiny models the bf16 eager model itself is 11-21% of
a gradient's norm from fp32, so bf16 paths are compared by their distance to fp32, not to each other); two runs are
bitwise equal (the experts module's outputs and gradients, the model's log-probs); the trace proves it ran in every
MoE layer; ``verify`` still passes.
Skipped without CUDA."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from test_fused_decoder_cuda import _step

import actorcore as ac
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

COVERED = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v3", "qwen3_next",
           "qwen3_5_moe_text")
LENGTHS = (7, 64, 1, 33, 90)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in LENGTHS]).to("cuda")


def _model(model_type, **overrides):
    model = build_tiny_model(model_type, seed=1, dtype=torch.bfloat16, **overrides).cuda().train()
    model.set_experts_implementation("eager")  # transformers' per-expert loop (what "False" keeps)
    return model


def _compare(eager, path):
    (lp_e, ent_e, g_e), (lp_p, ent_p, g_p) = eager, path
    tol = TOL["moe_experts_vs_eager_bf16"]
    assert (lp_e - lp_p).abs().max().item() < tol and (ent_e - ent_p).abs().max().item() < tol
    assert g_e.keys() == g_p.keys()
    rel = TOL["grad_moe_experts_vs_eager_bf16_rel_norm"]
    for name in g_e:
        assert (g_e[name] - g_p[name]).norm().item() <= rel * g_e[name].norm().item() + 1e-6, name


def _routing(num_tokens, top_k, num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]).cuda()


def _module_runner(tokens, hidden, num_experts):
    """``run(module, forward, dtype)``: an experts forward on fixed random inputs (top-2 routing) and its gradients
    for the inputs, the routing weights and the module's parameters, all as float32."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)
    index = _routing(tokens, 2, num_experts, seed=3)
    weights = torch.rand(tokens, 2, generator=g).to("cuda", torch.bfloat16)
    grad = torch.randn(tokens, hidden, generator=g).to("cuda", torch.bfloat16)

    def run(module, forward, dtype):
        inputs = [x.to(dtype).requires_grad_(True), weights.to(dtype).requires_grad_(True)]
        out = forward(inputs[0], index, inputs[1])
        grads = torch.autograd.grad(out, [*inputs, *module.parameters()], grad.to(dtype))
        return [t.float() for t in (out, *grads)]

    return run


@pytest.mark.parametrize("model_type", COVERED)
def test_experts_module_within_bf16_rounding_of_eager(model_type):
    model = _model(model_type)
    handle = ac.patch_model(model, moe_experts="grouped", fused_decoder=False)
    experts = model.model.get_submodule(handle.state.targets("moe_experts")[0])
    from actorcore.hf.features.class_paths import TRACE_ATTR
    from actorcore.hf.features.moe_experts import MOE_EXPERTS_KEY

    reference = copy.deepcopy(experts).float()  # fp32 math from the same bf16 values: the yardstick
    reference.__class__ = reference._actorcore_base  # transformers' own experts class
    reference.__dict__.pop(TRACE_ATTR)
    run = _module_runner(301, model.config.hidden_size, experts.num_experts)
    want = run(reference, reference.forward, torch.float32)
    eager = run(experts, experts._actorcore_base.forward.__get__(experts), torch.bfloat16)
    handle.state.trace.counts = Counter()  # as inside an actorcore call
    try:
        path = run(experts, experts, torch.bfloat16)
        assert handle.state.trace.counts[MOE_EXPERTS_KEY] == 1
        again = run(experts, experts, torch.bfloat16)
    finally:
        handle.state.trace.counts = None
    _assert_module_runs(experts, want, eager, path, again)
    handle.revert()


def _assert_module_runs(module, want, baseline, path, again):
    """Two runs of the path bitwise equal; each output and gradient within bf16 rounding of fp32 (``want``) and no
    further from it than the baseline bf16 run (twice its error, plus a floor)."""
    names = ["out", "x", "weights", *[n for n, _ in module.named_parameters()]]
    for name, a, b in zip(names, path, again):
        assert torch.equal(a, b), f"two runs differ in {name}"
    for name, w, e, p in zip(names, want, baseline, path):
        scale = w.abs().max().item()
        err_base, err_path = (e - w).abs().max().item(), (p - w).abs().max().item()
        assert err_path <= TOL["moe_experts_module_vs_fp32_bf16_rel"] * scale, (name, err_path, scale)
        assert err_path <= 2 * err_base + 1e-3 * scale, (name, err_path, err_base)


@pytest.mark.parametrize("model_type", COVERED)
@pytest.mark.parametrize("fused", [False, True])
def test_model_matches_eager_experts_and_ran(model_type, fused):
    if fused:
        pytest.importorskip("triton")
    from torch._dynamo.utils import guard_failures

    from actorcore.archs import get_spec
    from actorcore.hf.features.fused_decoder import FUSED_TRACE_KEY
    from actorcore.hf.features.moe_experts import MOE_EXPERTS_KEY

    # The tiny Qwen3-Next's one MoE block sits in its linear-attention layer, which stays eager: here it moves to the
    # full-attention layer, so that a compiled layer holds experts (Qwen3.5-MoE keeps MoE in an eager layer).
    model = _model(model_type, **(dict(mlp_only_layers=[0]) if model_type == "qwen3_next" else {}))
    batch = _batch()
    handle = ac.patch_model(model, moe_experts=False, fused_decoder=False)  # eager decoder, eager experts
    eager = _step(model, batch, Counter())
    handle.revert()
    handle = ac.patch_model(model, fused_decoder=fused)  # "auto", the default: the path where the decoder is fused
    refused = get_spec(model_type).linear_attention is not None  # hybrids keep their own experts under "auto"
    assert bool(handle.state.targets("moe_experts")) == (fused and not refused)
    handle.revert()
    handle = ac.patch_model(model, fused_decoder=fused, moe_experts="grouped")
    modules = len(handle.state.targets("moe_experts"))
    assert modules >= 1
    trace = Counter()
    path = _step(model, batch, trace)
    if fused:  # compiled layers take the path by construction, with one compilation for every layer
        from actorcore.hf.features.class_paths import names_inside as _names_inside

        compiled = _names_inside(handle.parts.decoder, [handle.parts.layers[i] for i in handle.state.targets("fused_decoder")],
                                 handle.state.targets("moe_experts"))
        assert compiled and trace[FUSED_TRACE_KEY] == len(handle.state.targets("fused_decoder"))
        assert trace[MOE_EXPERTS_KEY] == modules - len(compiled)  # the hybrids' linear-attention layers stay eager
        assert not [r for reasons in guard_failures.values() for r in reasons if "experts" in str(r)], guard_failures
    else:
        assert trace[MOE_EXPERTS_KEY] == modules
    if fused:  # log-probs and entropies within bf16 rounding; the gradients: test_fused_path_as_close_to_fp32_...
        tol = TOL["moe_experts_vs_eager_bf16"]
        assert (eager[0] - path[0]).abs().max().item() < tol and (eager[1] - path[1]).abs().max().item() < tol
    else:
        _compare(eager, path)
    again = _step(model, batch, Counter())  # forward bitwise (flash attention's backward accumulates with atomics)
    for a, b in zip(path[:2], again[:2]):
        assert torch.equal(a, b), "two runs differ"
    report = ac.verify(model, batch)  # the model's own forward keeps its own experts code
    assert report.ok, report
    handle.revert()


def _fp32_reference(model, batch):
    """The same bf16 values in fp32, eager decoder, transformers' eager experts: log-probs, entropies, gradients."""
    reference = copy.deepcopy(model).float()
    reference.set_experts_implementation("eager")
    handle = ac.patch_model(reference, moe_experts=False, fused_decoder=False)
    out = _step(reference, batch, Counter())
    handle.revert()
    return out


def _distance(run, reference):
    """Max |Δ log-prob| and each parameter's gradient distance as a fraction of the reference gradient's norm."""
    grads = {n: ((run[2][n] - g).norm() / (g.norm() + 1e-12)).item() for n, g in reference[2].items()}
    return (run[0] - reference[0]).abs().max().item(), grads


@pytest.mark.parametrize("model_type", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason="measured further from fp32 on the DeltaNet decay "
                                            "gradients: its spec keeps transformers' experts under 'auto'"))
    if m == "qwen3_next" else m for m in COVERED])
def test_fused_path_as_close_to_fp32_as_transformers_experts(model_type):
    """Under the fused decoder, the path against transformers' own ``grouped_mm`` experts under the same fused
    decoder, both measured by their distance to the fp32 model (same values, eager): per token in log-probs and per
    parameter in gradients the path is no further from fp32 than transformers' experts, up to the table's factor
    and floor. Where it is not (qwen3_next: strict xfail), the spec keeps the model's own experts under ``"auto"``,
    and the xfail turns into a failure the day the path is as close."""
    pytest.importorskip("triton")
    model = _model(model_type)
    batch = _batch()
    reference = _fp32_reference(model, batch)
    model.set_experts_implementation("grouped_mm")
    distances = {}
    for experts in (False, "grouped"):
        handle = ac.patch_model(model, fused_decoder=True, moe_experts=experts)
        assert bool(handle.state.targets("moe_experts")) == (experts == "grouped")
        distances[experts] = _distance(_step(model, batch, Counter()), reference)
        handle.revert()
    _assert_no_further_from_fp32(distances["grouped"], distances[False], "transformers' experts")


def _assert_no_further_from_fp32(path, baseline, baseline_name):
    """The path's ``_distance`` to the fp32 model within the table's factor (plus a floor) of the baseline's: its
    max log-prob difference and every parameter's gradient distance."""
    (lp_b, grads_b), (lp_p, grads_p) = baseline, path
    factor, floor = TOL["moe_path_vs_fp32_over_transformers_factor"], TOL["moe_path_vs_fp32_over_transformers_floor"]
    assert lp_p <= factor * lp_b + floor, (lp_p, lp_b)
    worse = {n: (round(grads_p[n], 4), round(grads_b[n], 4))
             for n in grads_b if grads_p[n] > factor * grads_b[n] + floor}
    assert not worse, f"gradients further from fp32 than {baseline_name} (path, {baseline_name}): {worse}"
