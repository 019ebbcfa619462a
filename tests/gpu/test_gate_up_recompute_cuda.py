"""CUDA (Hopper), quack installed: a layer kept but for its quack MLP's gate/up output (``checkpointing="auto"``'s
``"gate_up"`` mode). The kernel without the kept pre-activation gives bitwise the output and every gradient of the
kernel that keeps it, and saves no ``[T, 2I]`` tensor; under the compiled decoder each layer is measured to keep a
pre-activation less (the compiled graph honours it), the step stays within bf16 rounding of the kept plan and of
the fp32 model; the planner mixes the mode into a budget whose peak holds. Skipped without CUDA or quack."""

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

INTERMEDIATE = 2816


def _model(layers):
    return build_tiny_model("llama", seed=0, dtype=torch.bfloat16, hidden_size=1024, intermediate_size=INTERMEDIATE,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_hidden_layers=layers,
                            vocab_size=4096).cuda().train()


def _batch():
    g = torch.Generator().manual_seed(0)
    return ac.pack([torch.randint(3, 4096, (int(n),), generator=g)
                    for n in torch.randint(300, 1500, (16,), generator=g)]).to("cuda")


def test_kernel_without_the_kept_preactivation_is_bitwise():
    from actorcore.kernels.quack.gated_mlp import gated_mlp

    tokens, hidden, inner = 2048, 512, 1408
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [(0.03 * torch.randn(*shape, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_()
               for shape in ((inner, hidden), (inner, hidden), (hidden, inner))]
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    grad = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)

    def run(keep):
        saved = []
        xs = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            out = gated_mlp(xs, *weights, keep_preact=keep)
        return [out, *torch.autograd.grad(out, (xs, *weights), grad)], saved

    kept, kept_saved = run(True)
    (recomputed, recomputed_saved), ran = quack_kernels_ran(lambda: run(False))
    assert ran, "no quack kernel ran"
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    assert (tokens, 2 * inner) in kept_saved and (tokens, 2 * inner) not in recomputed_saved


def test_compiled_layers_keep_no_preactivation(monkeypatch):
    """Each layer forced to ``"none"`` then ``"gate_up"``: the allocator's bytes each layer holds after its forward
    (``LayerBytesMeter``) drop by a pre-activation, the trace counts the layers, and the step is within bf16 rounding
    of the kept plan and no further from the fp32 model."""
    pytest.importorskip("triton")
    import actorcore.hf.features.checkpointing as checkpointing
    from actorcore.hf.features.checkpointing import GATE_UP_LAYERS, UNCHECKPOINTED_LAYERS
    from actorcore.hf.patch import patch_state

    layers = 4
    model, batch = _model(layers), _batch()
    reference = copy.deepcopy(model).float()
    plain = ac.patch_model(reference, compiled_decoder=False, swiglu_mlp=False)
    want = step(reference, batch, Counter())
    plain.revert()
    del reference
    forced = {"modes": None}
    monkeypatch.setattr(checkpointing, "plan_layer_modes", lambda *args, **kwargs: list(forced["modes"]))
    handle = ac.patch_model(model, checkpointing="auto", memory_budget_gib=1e3)
    assert handle.state.targets("swiglu_mlp") and handle.state.targets("compiled_decoder")
    runs = {}
    for mode in ("none", "gate_up"):
        forced["modes"] = [mode] * layers
        trace = Counter()
        runs[mode], ran = quack_kernels_ran(lambda: step(model, batch, trace))
        assert ran, "no quack kernel ran"
        assert trace[GATE_UP_LAYERS] == (layers if mode == "gate_up" else 0)
        assert trace[UNCHECKPOINTED_LAYERS] == (layers if mode == "none" else 0)
    measured = patch_state(model).measured_layer_bytes
    preact = 2 * INTERMEDIATE * 2  # bytes per token of a bf16 [T, 2I] pre-activation
    for i in range(layers):
        dropped = measured[(i, "none")] - measured[(i, "gate_up")]
        assert dropped >= 0.9 * preact, (i, measured)
    kept, recomputed = runs["none"], runs["gate_up"]
    tol = TOL["compiled_decoder_vs_eager_bf16"]
    assert (kept[0] - recomputed[0]).abs().max().item() < tol and (kept[1] - recomputed[1]).abs().max().item() < tol
    assert_no_further_from_fp32(grad_distance(recomputed, want), grad_distance(kept, want), "the gate/up recompute")
    print("gate_up vs none bitwise:", all(torch.equal(a, b) for a, b in zip(kept[:2], recomputed[:2]))
          and all(torch.equal(kept[2][n], recomputed[2][n]) for n in kept[2]))
    handle.revert()


def test_full_checkpoint_inside_the_graph_keeps_only_the_inputs():
    """``checkpointing="full"`` on compiled layers with quack's gated MLP: each layer checkpointed inside its compiled
    graph saves for backward its inputs and weights only (no ``[T, I]`` or ``[T, 2I]`` tensor: torch 2.11 kept the
    pre-activation of the autograd.Function under a plain checkpoint), quack's kernels run, and the step is within
    bf16 rounding of the fp32 model as the layers kept whole are."""
    pytest.importorskip("triton")
    from actorcore.hf.features.compiled_decoder import CHECKPOINTED_IN_GRAPH_KEY

    layers = 3
    model, batch = _model(layers), _batch()
    tokens = batch.num_tokens
    reference = copy.deepcopy(model).float()
    plain = ac.patch_model(reference, compiled_decoder=False, swiglu_mlp=False)
    want = step(reference, batch, Counter())
    plain.revert()
    del reference
    kept = ac.patch_model(model)
    whole = step(model, batch, Counter())
    kept.revert()
    handle = ac.patch_model(model, checkpointing="full")
    assert handle.state.targets("swiglu_mlp") and handle.state.targets("compiled_decoder")
    trace, saved = Counter(), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        full, ran = quack_kernels_ran(lambda: step(model, batch, trace))
    assert ran, "no quack kernel ran"
    assert trace[CHECKPOINTED_IN_GRAPH_KEY] == layers, dict(trace)
    assert not [n for n in saved if n >= tokens * INTERMEDIATE], sorted(saved)[-8:]
    tol = TOL["compiled_decoder_vs_eager_bf16"]
    assert (whole[0] - full[0]).abs().max().item() < tol and (whole[1] - full[1]).abs().max().item() < tol
    assert_no_further_from_fp32(grad_distance(full, want), grad_distance(whole, want), "the in-graph checkpoint")
    handle.revert()


def test_auto_mixes_gate_up_layers_within_the_budget():
    """A budget the planner fills with gate/up-recomputed layers beside kept and fully checkpointed ones, from the
    estimate, then from what the first call measured (fewer fully checkpointed): the peak stays within it."""
    pytest.importorskip("triton")
    from actorcore.hf.features.checkpointing import (FULL_LAYERS, GATE_UP_LAYERS, UNCHECKPOINTED_LAYERS,
                                                     gradients_to_come, layer_bytes_per_token)

    layers = 8
    model, batch = _model(layers), _batch()
    config, tokens = model.config, batch.num_tokens
    estimate, checkpointed_input = layer_bytes_per_token(config, 2, fused=True)
    grads, head_grad = gradients_to_come(model, list(model.model.layers))  # the last layer's backward allocates
    budget = (torch.cuda.memory_allocated() + layers * checkpointed_input * tokens + 2**30 + 4.8 * estimate * tokens
              + grads[-1] + head_grad)
    handle = ac.patch_model(model, checkpointing="auto", memory_budget_gib=budget / 2**30)
    plans = {}
    for call in ("estimated", "measured"):
        trace = Counter()
        torch.cuda.reset_peak_memory_stats()
        step(model, batch, trace)
        assert trace[GATE_UP_LAYERS] >= 1, (call, dict(trace))
        assert torch.cuda.max_memory_allocated() <= budget, call
        plans[call] = (trace[FULL_LAYERS], trace[GATE_UP_LAYERS], trace[UNCHECKPOINTED_LAYERS])
    assert plans["estimated"][0] >= 1  # the estimate errs on the safe side: some layers fully checkpointed
    assert plans["measured"][0] <= plans["estimated"][0], plans
    handle.revert()
