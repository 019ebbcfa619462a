"""``patch_model(checkpointing=...)``: selective checkpointing keeps matmul / attention outputs and recomputes the
rest; against full layer checkpointing of the same model: bitwise the same log-probs, entropies and every
gradient (every registered architecture in bf16, VLMs on an image batch; five families in fp32 too; gpt-oss, whose
experts write into their GEMM outputs, also with recomputed norms and under ``"auto"``), alone and composed with tiled MLP and
activation offload; ``"auto"`` fits a budget per layer; the self-check proves the selective checkpoints ran; bad options are refused; the compiled decoder stays off on the CPU."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from support.decoder_steps import assert_bitwise, seeded_batch, train_step

import actorcore as ac
from actorcore.archs import get_spec, registered_model_types
from actorcore.hf.call import DecoderParts
from actorcore.hf.features.checkpointing import (
    FULL_LAYERS,
    GATE_UP_LAYERS,
    SELECTIVE_LAYERS,
    CallShape,
    CheckpointPlan,
    gradients_to_come,
    head_gradient_bytes,
    layer_bytes_per_token,
    layer_forward_flops,
    mean_context,
    plan_layer_modes,
)
from actorcore.hf.features.compiled_decoder import original_forward
from actorcore.hf.patch import PatchNotAppliedError, patch_state
from actorcore.kernels.selective_checkpoint import (SELECTIVE_TRACE_KEY, KeptLayer, cheapest_plan, is_expensive,
                                                    layers_to_keep)
from actorcore.testing.reference import reference_logprobs, right_padded
from actorcore.testing.tiny_configs import build_tiny_model, checkpointed
from actorcore.testing.tolerances import TOL
from transformers.modeling_layers import GradientCheckpointingLayer


def _full_then(model, batch, composed=None, **patch):
    """(the step under checkpointing='full', the step under ``patch``, the second step's trace); both with the
    ``composed`` patch options."""
    composed = composed or {}
    handle = ac.patch_model(model, checkpointing="full", **composed)
    full = train_step(model, batch, Counter())
    handle.revert()
    model.zero_grad(set_to_none=True)
    handle = ac.patch_model(model, **patch, **composed)
    trace = Counter()
    other = train_step(model, batch, trace)
    handle.revert()
    return full, other, trace


ARCHS = sorted(m for m in registered_model_types() if not (get_spec(m).vision is not None and get_spec(m).vision.refused))
# fp32 as well as bf16: the families of the original test and gpt-oss (whose experts write into their GEMM outputs).
FP32_ARCHS = ("llama", "qwen3", "qwen3_moe", "qwen3_5_text", "gpt_oss")


def _model_and_batch(model_type, dtype, seed=3):
    """A tiny model of any registered architecture and a batch for it (a VLM's with an image and a text-only
    sequence)."""
    if get_spec(model_type).vision is None:
        return build_tiny_model(model_type, seed=seed, dtype=dtype).train(), seeded_batch()
    from actorcore.hf.vlm.packing import pack_multimodal
    from actorcore.testing.tiny_vlm import build_tiny_vlm, synthetic_sample

    model = build_tiny_vlm(model_type, seed=seed, dtype=dtype).train()
    g = torch.Generator().manual_seed(seed)
    samples = [synthetic_sample(model, images=[(4, 4)], text_lengths=(6, 9), generator=g),
               synthetic_sample(model, text_lengths=(13,), generator=g)]
    inputs = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in s.multimodal.items()} for s in samples]
    return model, pack_multimodal(model, [s.input_ids for s in samples], inputs)


@pytest.mark.parametrize("model_type, dtype", [(m, torch.bfloat16) for m in ARCHS]
                         + [(m, torch.float32) for m in FP32_ARCHS])
def test_selective_is_bitwise_full_checkpointing(model_type, dtype):
    """Every registered architecture: log-probs, entropies and every gradient bitwise those of full checkpointing,
    and one selective checkpoint per layer ran."""
    model, batch = _model_and_batch(model_type, dtype)
    layers = len(DecoderParts.of(model, get_spec(model_type)).layers)
    full, selective, trace = _full_then(model, batch, checkpointing="selective")
    assert_bitwise(full, selective)
    assert trace[SELECTIVE_LAYERS] == layers and trace[FULL_LAYERS] == 0
    assert trace[SELECTIVE_TRACE_KEY] == layers  # one selective checkpoint per layer (its contexts serve forward and recompute)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_selective_with_recomputed_norms_and_auto(dtype):
    """gpt-oss's experts add their bias in place into their grouped GEMMs' output (transformers' grouped_mm
    experts): selective checkpointing recomputes those GEMMs instead of keeping them, also with recomputed norms
    and under ``"auto"`` where it keeps layers; per token against the model's own forward in fp32."""
    model, batch = _model_and_batch("gpt_oss", dtype)
    layers = model.config.num_hidden_layers
    full, other, trace = _full_then(model, batch, {"recompute_norms": True}, checkpointing="selective")
    assert_bitwise(full, other)
    assert trace[SELECTIVE_TRACE_KEY] == layers and trace["recompute_norms:forward"] > 0
    model.zero_grad(set_to_none=True)
    full, other, trace = _full_then(model, batch, checkpointing="auto", memory_budget_gib=1e6)
    assert_bitwise(full, other)
    assert trace[SELECTIVE_LAYERS] == layers
    if dtype == torch.float32:  # the model's own forward (padded, unpatched), per token
        bounds = batch.cu_seqlens.tolist()
        sequences = [batch.input_ids[a:b] for a, b in zip(bounds, bounds[1:])]
        with torch.no_grad():
            want, _ = reference_logprobs(model, *right_padded(sequences), temperature=0.9)
        assert (other[0] - want).abs().max().item() < TOL["packed_vs_hf_fp32"]


def test_auto_mixes_layers_to_the_budget_and_stays_bitwise():
    model = build_tiny_model("qwen3", seed=4, dtype=torch.bfloat16, num_hidden_layers=4).train()
    batch = seeded_batch()
    config, layers = model.config, model.config.num_hidden_layers
    kept, _ = layer_bytes_per_token(config, 2, fused=False)
    base = plan_layer_modes(CheckpointPlan("auto", 0.0), [False] * layers, CallShape(batch.num_tokens, 2, 0), config)
    assert base == ["full"] * layers  # no room: all fully checkpointed
    # Room for 3 layers above the checkpointed inputs and the slack: a fully checkpointed step's recompute, or two
    # kept layers and the gradients of the one in backward. The last two layers run selectively.
    ckpt_inputs = layers * config.hidden_size * 2 * batch.num_tokens
    budget = ckpt_inputs + 2**30 + 3 * kept * batch.num_tokens + 1
    shape = CallShape(batch.num_tokens, 2, 0)
    modes = plan_layer_modes(CheckpointPlan("auto", budget), [False] * layers, shape, config)
    assert modes == ["full"] * (layers - 2) + ["selective"] * 2
    tight = plan_layer_modes(CheckpointPlan("auto", budget - 2), [False] * layers, shape, config)
    assert tight == ["full"] * layers  # under 3 layers of room nothing is kept
    # A step's first call allocates every gradient anew: where the kept layers' backward runs, only the last layers'
    # and the head's exist, so with room for all of them at the first layer's backward it keeps more.
    grads, head_grad = gradients_to_come(model, list(model.model.layers))
    budget += sum(grads) + head_grad
    first_call = plan_layer_modes(CheckpointPlan("auto", budget), [False] * layers,
                                  CallShape(batch.num_tokens, 2, 0, head_bytes=head_gradient_bytes(model),
                                            grads_to_come=grads, head_grad_to_come=head_grad), config)
    assert first_call == ["selective"] * layers  # (the tiny model's gradients outweigh its activations)
    handle = ac.patch_model(model, checkpointing="full")
    want = [train_step(model, batch, Counter()) for _ in range(2)]  # the second accumulates into the first
    handle.revert()
    model.zero_grad(set_to_none=True)
    handle = ac.patch_model(model, checkpointing="auto", memory_budget_gib=budget / 2**30)
    traces = [Counter(), Counter()]
    got = [train_step(model, batch, trace) for trace in traces]
    handle.revert()
    for a, b in zip(want, got):
        assert_bitwise(a, b)
    assert traces[0][SELECTIVE_LAYERS] == layers and traces[0][FULL_LAYERS] == 0
    # (the second call plans with the allocator's count of the gradients now there: on CUDA only)
    roomy = plan_layer_modes(CheckpointPlan("auto", 1e15), [False] * layers, CallShape(batch.num_tokens, 2, 0), config)
    assert roomy == ["selective"] * layers
    fused = plan_layer_modes(CheckpointPlan("auto", 1e15), [True] * layers, CallShape(batch.num_tokens, 2, 0), config)
    assert fused == ["none"] * layers  # a compiled layer keeps its compiled graph's tensors instead


def test_auto_counts_the_head_gradient_and_the_gradients_still_to_come():
    """The LM head's weight gradient is alive beside every kept layer until the last layer's backward (not with it);
    a call whose gradients are not yet allocated (a step's first micro-batch) counts each one from where backward
    makes it: the head's from the start, a layer's from its own backward on; the fully checkpointed layers' backward
    comes after all of them."""
    model = build_tiny_model("qwen3", seed=4, dtype=torch.bfloat16, num_hidden_layers=4).train()
    config, layers, tokens = model.config, model.config.num_hidden_layers, 100
    kept = layer_bytes_per_token(config, 2, fused=False)[0] * tokens
    base = layers * config.hidden_size * 2 * tokens + 2**30

    def plan(room, **shape):
        return plan_layer_modes(CheckpointPlan("auto", base + room), [False] * layers, CallShape(tokens, 2, 0, **shape),
                                config)

    # Four kept layers: 4 kept + the last one's gradients at its backward.
    assert plan(5 * kept + 1) == ["selective"] * 4
    assert plan(5 * kept + 1, head_bytes=kept) == ["selective"] * 4  # the head's gradient, gone before that peak
    assert plan(5 * kept + 1, head_bytes=1.5 * kept) == ["full"] + ["selective"] * 3  # 4 kept + 1.5 before backward
    # The head's gradient allocated anew stays (it becomes .grad): at the last layer's backward too.
    assert plan(5 * kept + 1, head_bytes=kept, head_grad_to_come=kept) == ["full"] + ["selective"] * 3
    # Each layer's gradients from its backward on: the fully checkpointed layers' backward has all of them.
    with pytest.warns(UserWarning, match="cannot be met"):
        assert plan(3 * kept + 1, grads_to_come=(kept / 8,) * layers) == ["full"] * layers
    assert plan(3.5 * kept + 1, grads_to_come=(kept / 8,) * layers) == ["full"] * 2 + ["selective"] * 2

    grads, head = gradients_to_come(model, list(model.model.layers))
    per_layer = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers]
    assert grads == tuple(per_layer) and head == head_gradient_bytes(model)
    assert head == config.vocab_size * config.hidden_size * 2  # the tiny model's untied head, bf16
    train_step(model, seeded_batch(), Counter())  # now every gradient is allocated: nothing more to come
    assert gradients_to_come(model, list(model.model.layers)) == ((0.0,) * layers, 0.0)
    model.zero_grad(set_to_none=True)
    model.lm_head.weight.requires_grad_(False)  # a frozen head forms no gradient
    assert head_gradient_bytes(model) == 0.0 and gradients_to_come(model, list(model.model.layers))[1] == 0.0


def test_auto_counts_offloaded_inputs_off_the_gpu():
    """With activation offload the moved inputs are not on the GPU but for the two under way: K (the first K
    layers, a compiled one among them fully checkpointed), or ``"auto"``, where a kept layer's input stays with it
    and only the fully checkpointed (leading) layers' move."""
    config = build_tiny_model("qwen3", num_hidden_layers=8).config
    tokens, layers = 100, 8
    kept, inp = (b * tokens for b in layer_bytes_per_token(config, 2, fused=False))

    def plan(room, fused=False, **kwargs):
        budget = 2**30 + room
        return plan_layer_modes(CheckpointPlan("auto", budget), [fused] * layers, CallShape(tokens, 2, 0), config,
                                **kwargs)

    # The first four offloaded: four inputs on the GPU and two under way, then room for two kept layers.
    room = 6 * inp + 3 * kept + 1
    assert plan(room, offloaded=4) == ["full"] * 6 + ["selective"] * 2
    with pytest.warns(UserWarning, match="cannot be met"):
        assert plan(room) == ["full"] * layers  # all eight inputs on the GPU: no room
    assert plan(8 * inp + 3 * kept + 1, fused=True, offloaded=4)[:4] == ["full"] * 4  # compiled: not kept among them
    # "auto": two under way, and each kept layer with its input (at the second's backward: two of each, its gradients).
    room = 2 * inp + 2 * (kept + inp) + kept + 1
    assert plan(room, offloaded="auto") == ["full"] * 6 + ["selective"] * 2
    assert plan(room - 2, offloaded="auto") == ["full"] * 7 + ["selective"]


def test_auto_plans_with_what_the_kept_layers_were_measured_to_hold(monkeypatch):
    """A call measures, per kept layer, the allocator's bytes held after its forward (the CUDA allocator's count;
    here a counter each layer's MLP advances); the next call plans with the measurement instead of the estimate,
    the recompute in backward is not measured, and no hook is left on the layers."""
    import actorcore.hf.features.checkpointing as checkpointing

    model = build_tiny_model("qwen3", seed=4, dtype=torch.bfloat16, num_hidden_layers=4).train()
    batch = seeded_batch()
    config, layers, tokens = model.config, model.config.num_hidden_layers, batch.num_tokens
    estimate, _ = layer_bytes_per_token(config, 2, fused=False)
    holds = estimate / 4  # what each layer holds beyond a checkpointed layer, per token
    counter = {"bytes": 0, "mlp_calls": 0}

    def hold(module, args, output):  # the layer's output (a checkpointed layer holds it too) and its activations
        counter["bytes"] += int((holds + config.hidden_size * 2) * tokens)
        counter["mlp_calls"] += 1

    for layer in model.model.layers:
        layer.mlp.register_forward_hook(hold)
    monkeypatch.setattr(checkpointing, "allocated_bytes_counter", lambda device: lambda: counter["bytes"])
    for param in model.parameters():  # a later micro-batch: the gradients are there (and, here, not counted)
        param.grad = torch.zeros_like(param)
    budget = layers * config.hidden_size * 2 * tokens + 2**30 + 3 * estimate * tokens + 1
    handle = ac.patch_model(model, checkpointing="auto", memory_budget_gib=budget / 2**30)
    first, second = Counter(), Counter()
    train_step(model, batch, first)
    counter["bytes"] = 0  # backward freed the activations
    assert first[SELECTIVE_LAYERS] == 2 and first[FULL_LAYERS] == layers - 2  # the estimate: room for 3 layers
    assert counter["mlp_calls"] >= layers  # the forward (the recompute may stop early, before the MLP's hook)
    measured = patch_state(model).measured_layer_bytes
    assert measured.keys() == {(2, "selective"), (3, "selective")}
    for value in measured.values():
        assert value == pytest.approx(holds * 1.05, rel=1e-3)  # the recompute in backward did not add to it
    train_step(model, batch, second)
    # Layers 2 and 3 measured at a quarter of the estimate, 0 and 1 (not yet measured) at the estimate: in
    # backward at layer 1, layers 0 and 1 and layer 1's gradients, 3 estimates: all four fit.
    assert second[SELECTIVE_LAYERS] == layers
    assert measured.keys() == {(i, "selective") for i in range(layers)}
    assert all(not layer._forward_pre_hooks and len(layer._forward_hooks) == 0 for layer in model.model.layers)
    handle.revert()


def test_layers_to_keep_and_the_policy():
    assert layers_to_keep(10.0, 4.0, [2.0] * 8) == 2  # room for 3: two kept and the gradients of one
    assert layers_to_keep(12.0, 4.0, [2.0] * 8) == 3
    with pytest.warns(UserWarning, match=r"budget of 9 GiB cannot be met"):
        assert layers_to_keep(9.0 * 2**30, 4.0 * 2**30, [2.0 * 2**30] * 8) == 0  # room for 2: not even a recompute
    with pytest.warns(UserWarning, match=r"budget of 10 GiB cannot be met"):
        assert layers_to_keep(10.0 * 2**30, 12.0 * 2**30, [2.0 * 2**30] * 8) == 0
    assert layers_to_keep(1e9, 0.0, [2.0] * 8) == 8
    # Layers of unequal bytes (a hybrid's two kinds, or measured ones): at each kept layer in backward, the kept
    # layers before it and its gradients.
    assert layers_to_keep(4.0 + 9, 4.0, [3.0, 3.0, 1.0, 1.0]) == 4  # 3 + 3 + 1 + 1 + 1; at the second: 3 + 3 + 3
    assert layers_to_keep(4.0 + 9, 4.0, [1.0, 1.0, 3.0, 3.0]) == 2  # 3 + 3 + 3; one more: 1 + 3 + 3 + 3
    assert layers_to_keep(4.0 + 9, 4.0, [1.0, 3.0, 1.0, 3.0]) == 2  # one more: 3 + 1 + 3, and 3
    assert layers_to_keep(4.0 + 8.9, 4.0, [3.0, 3.0, 1.0, 1.0]) == 0  # under 3 of the largest
    assert is_expensive(torch.ops.aten.mm.default) and is_expensive(torch.ops.aten.addmm.default)
    assert not is_expensive(torch.ops.aten.mul.Tensor) and not is_expensive(torch.ops.aten._softmax.default)
    import actorcore.kernels.attention.fa4  # noqa: F401 (registers the FA4 ops)

    assert is_expensive(torch.ops.actorcore.fa4_varlen_forward.default)  # the attention, kept
    assert not is_expensive(torch.ops.actorcore.fa4_varlen_backward.default)


def test_cheapest_plan_mixes_partial_layers_where_they_redo_less():
    """Kept layers (24.6 bytes, their gradients as much again), partial ones (13.3, a backward peak of 35.9: the
    gradients and what they make again; 11.5 of work redone) and full ones (24.5 of work redone): the plan with the
    least work redone whose backward peak fits, full first, partial, kept last."""
    kept, partial = KeptLayer(24.6, 24.6), KeptLayer(13.3, 35.9, 11.5)
    full = [24.5] * 8
    # One kept (peak 49.2) and five partial (+13.3 each: 115.7 <= 118): 2 full + 5 partial = 106.5 of work; three
    # kept and one partial (111.7) would redo 109.5, six partial (115.7) 118, kept-or-full only 122.5.
    assert cheapest_plan(118, 0, full, [kept] * 8, [partial] * 8) == ["full"] * 2 + ["partial"] * 5 + ["kept"]
    assert cheapest_plan(118, 0, full, [kept] * 8) == ["full"] * 5 + ["kept"] * 3  # layers_to_keep's plan
    # Layers without a partial way are kept in the partial stretch: 4 full + 1 partial (layer 4) + 3 kept = 109.5.
    assert cheapest_plan(118, 0, full, [kept] * 8, [partial, None] * 4) == ["full"] * 4 + ["partial"] + ["kept"] * 3
    assert cheapest_plan(75, 0, full, [kept] * 8, [partial] * 8) == ["full"] * 6 + ["kept"] * 2  # partial costs more
    assert cheapest_plan(1e9, 0, full, [kept] * 8, [partial] * 8) == ["kept"] * 8
    unreachable = KeptLayer(24.6, float("inf"))  # a layer that must stay fully checkpointed (offloaded)
    assert cheapest_plan(1e9, 0, full, [unreachable] * 2 + [kept] * 6, [None] * 2 + [partial] * 6) == \
        ["full"] * 2 + ["kept"] * 6


def test_auto_offers_gate_up_on_compiled_layers_with_quack_mlps():
    """``plan_layer_modes``: a compiled layer with a quack MLP (its intermediate width in ``gate_up_widths``) may run
    ``"gate_up"``, estimated to keep a ``[T, 2I]`` pre-activation less than kept whole, or measured; an eager layer
    or one without quack's MLP never; the FLOPs that decide it from the config and the batch's attention context."""
    config = build_tiny_model("llama", num_hidden_layers=8).config
    d, inner, tokens = config.hidden_size, config.intermediate_size, 1000
    estimate, checkpointed_input = layer_bytes_per_token(config, 2, fused=True)
    preact = 2 * inner * 2
    flops = layer_forward_flops(config, 100.0)
    assert flops == 2 * (d * (2 * d + 2 * 2 * 16) + 3 * d * inner) + 4 * d * 100  # 2 kv heads of 16
    assert mean_context(torch.tensor([0, 3, 4], dtype=torch.int32)) == pytest.approx((1 + 2 + 3 + 1) / 4)
    base = 8 * checkpointed_input * tokens + 2**30
    shape = CallShape(tokens, 2, 0, 100.0, (inner,) * 8)
    budget = base + 4.5 * estimate * tokens  # room for 4.5 kept layers: fewer kept, some gate_up, redoes less
    modes = plan_layer_modes(CheckpointPlan("auto", budget), [True] * 8, shape, config)
    assert modes.count("gate_up") >= 2 and modes[-1] == "none" and modes[0] == "full", modes
    assert modes == sorted(modes, key=["full", "gate_up", "none"].index)
    kept_or_full = plan_layer_modes(CheckpointPlan("auto", budget), [True] * 8, CallShape(tokens, 2, 0, 100.0), config)
    assert "gate_up" not in kept_or_full and kept_or_full.count("none") == 3
    assert "gate_up" not in plan_layer_modes(CheckpointPlan("auto", budget), [False] * 8, shape, config)
    # measured: kept whole at the estimate, gate_up at a tenth of it, fits four more layers that way
    measured = {(i, "gate_up"): estimate / 10 for i in range(8)}
    cheap = plan_layer_modes(CheckpointPlan("auto", budget), [True] * 8, shape, config, measured)
    assert cheap.count("full") < modes.count("full"), (cheap, modes)
    # not measured: a kept whole layer's measurement less the pre-activation
    small = {(i, "none"): float(preact + 8) for i in range(8)}
    assert plan_layer_modes(CheckpointPlan("auto", base + 3 * (preact + 8) * tokens), [True] * 8, shape, config,
                            small).count("full") == 0


def test_a_compiled_full_layer_costs_its_forward_without_the_down_projection(monkeypatch):
    """A compiled dense layer fully checkpointed inside its graph redoes its forward but the MLP's down projection
    (``2 d I`` FLOPs per token); an MoE layer's experts need their outputs (the routing weights' gradient), so it
    redoes all. The planner prices a compiled layer's full recompute that way, so it trades gate/up layers for full
    and kept ones where that redoes less; priced as a whole forward (as torch's checkpoint around the compiled layer
    redoes, and as a layer whose class falls back to that is priced) the same budget plans more gate/up layers."""
    import actorcore.hf.features.checkpointing as checkpointing

    dense = build_tiny_model("llama", num_hidden_layers=8).config
    d, inner = dense.hidden_size, dense.intermediate_size
    assert layer_forward_flops(dense, 100.0) - layer_forward_flops(dense, 100.0, down_projection=False) == 2 * d * inner
    moe = build_tiny_model("qwen3_moe").config
    assert layer_forward_flops(moe, 100.0, down_projection=False) == layer_forward_flops(moe, 100.0)
    # The Qwen2.5-1.5B shape's widths and measured bytes per token (kept whole, kept but for gate/up), 31K tokens.
    shape_15b = SimpleNamespace(hidden_size=1536, num_attention_heads=12, head_dim=128, num_key_value_heads=2,
                                intermediate_size=8960)
    layers, tokens = 28, 31000
    measured = {(i, mode): kb * 1e3 for i in range(layers) for mode, kb in (("none", 51.8), ("gate_up", 14.2))}
    shape = CallShape(tokens, 2, 6.16e9, 1500.0, (8960,) * layers, 151936 * 1536 * 2)
    plan = CheckpointPlan("auto", 40 * 2**30)
    priced = plan_layer_modes(plan, [True] * layers, shape, shape_15b, measured)
    whole = checkpointing.layer_forward_flops
    monkeypatch.setattr(checkpointing, "layer_forward_flops", lambda config, context, down_projection=True:
                        whole(config, context))
    as_whole_forwards = plan_layer_modes(plan, [True] * layers, shape, shape_15b, measured)
    assert priced.count("gate_up") < as_whole_forwards.count("gate_up"), (priced, as_whole_forwards)
    assert priced.count("none") > as_whole_forwards.count("none"), (priced, as_whole_forwards)
    # Layers whose class falls back to torch's checkpoint around the graph are priced as whole forwards.
    monkeypatch.undo()
    around = plan_layer_modes(plan, [True] * layers, shape, shape_15b, measured, in_graph=[False] * layers)
    assert around == as_whole_forwards


def test_gate_up_layers_run_uncheckpointed_and_bitwise(monkeypatch):
    """Layers planned ``"gate_up"`` (forced here: on the CPU no layer is compiled) run without a checkpoint, their
    quack MLPs (the stand-in) keeping no pre-activation: log-probs, entropies and every gradient bitwise those of
    full checkpointing, the modes counted; their forward runs once (a checkpointed layer's twice)."""
    import actorcore.hf.features.checkpointing as checkpointing
    from actorcore.hf.features.swiglu_mlp import GATE_UP_RECOMPUTED_KEY
    from actorcore.testing.quack_stand_in import use_quack_stand_in

    undo = use_quack_stand_in()
    try:
        model = checkpointed(build_tiny_model("llama", seed=2, num_hidden_layers=4))
        batch = seeded_batch()
        forced = ["full", "gate_up", "gate_up", "selective"]
        monkeypatch.setattr(checkpointing, "plan_layer_modes", lambda *args, **kwargs: list(forced))
        full, mixed, trace = _full_then(model, batch, {"swiglu_mlp": "quack"}, checkpointing="auto",
                                        memory_budget_gib=1e3)
        assert_bitwise(full, mixed)
        assert trace[GATE_UP_LAYERS] == 2 and trace[FULL_LAYERS] == 1 and trace[SELECTIVE_LAYERS] == 1
        assert trace[GATE_UP_RECOMPUTED_KEY] == 2
        forwards = Counter()
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_hook(lambda module, args, out, i=i: forwards.update([i]))
        handle = ac.patch_model(model, swiglu_mlp="quack", checkpointing="auto", memory_budget_gib=1e3)
        train_step(model, batch, Counter())
        handle.revert()
        assert forwards == {0: 2, 1: 1, 2: 1, 3: 2}
    finally:
        undo()


def test_composes_with_tiled_mlp_and_offload():
    model = checkpointed(build_tiny_model("qwen3", seed=5, dtype=torch.bfloat16))
    batch = seeded_batch()
    composed = {"tiled_mlp_shards": 3, "offload_activations": True}
    full, selective, trace = _full_then(model, batch, composed, checkpointing="selective")
    assert_bitwise(full, selective)
    assert trace["offload:layers"] == model.config.num_hidden_layers
    assert trace[SELECTIVE_LAYERS] == model.config.num_hidden_layers


def test_refusals_and_the_self_check(monkeypatch):
    model = build_tiny_model("llama", seed=7).train()
    for kwargs, match in (({"checkpointing": "some"}, "checkpointing must be"),
                          ({"checkpointing": "auto"}, "memory_budget_gib"),
                          ({"checkpointing": "auto", "memory_budget_gib": -1}, "memory_budget_gib"),
                          ({"memory_budget_gib": 4}, "checkpointing='auto'"),
                          ({"checkpointing": "full", "memory_budget_gib": 4}, "only used by"),
                          ({"compiled_decoder": True}, "not on a CUDA device"),
                          ({"compiled_decoder": "yes"}, "compiled_decoder must be")):
        with pytest.raises(ValueError, match=match):
            ac.patch_model(model, **kwargs)
    handle = ac.patch_model(model, checkpointing="selective")
    assert patch_state(model).targets("compiled_decoder") == ()  # "auto" on the CPU: eager, unchanged
    layer_class = type(model.model.layers[0])
    # As a transformers that ignored the layers' checkpoint function would: the class's plain forward and call.
    monkeypatch.setattr(layer_class, "forward", original_forward(layer_class))
    if "__call__" in GradientCheckpointingLayer.__dict__:
        monkeypatch.setattr(layer_class, "__call__", torch.nn.Module.__call__)
    with pytest.raises(PatchNotAppliedError, match="selective checkpointing ran in"):
        train_step(model, seeded_batch(), Counter())
    monkeypatch.undo()
    handle.revert()

