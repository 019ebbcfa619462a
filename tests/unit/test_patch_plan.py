"""The patch plan (``handle.plan``): every option's choice and why, printable and in ``verify``'s report; every pair of
``patch_model`` options (and a batch-invariant call) works as asked, per token and per gradient against the model's
own fp32 forward with the trace proving each requested feature ran, or is refused before any work; and the
interactions that used to drop or weaken what was asked, each as its own case.

On the CPU the compiled decoder (CUDA and 16-bit only) and the ``torch_varlen`` and ``fa4`` attention backends are
refused, quack's GEMMs run as the test stand-in (``actorcore.testing.quack_stand_in``), and the ``fa4`` pairs run
once more on FA4's stand-in (``actorcore.testing.fa4_stand_in``); ``tests/gpu/test_patch_plan_cuda.py`` runs the pairs
on CUDA."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import actorcore as ac
import actorcore.hf.features.compiled_decoder as compiled_decoder
from actorcore.hf.features.checkpointing import FULL_LAYERS, SELECTIVE_LAYERS, UNCHECKPOINTED_LAYERS
from support.option_pairs import (
    REFUSED,
    Tolerances,
    backend_refusals,
    checkpointed,
    model_type_for,
    option_pairs,
    own_forward,
    run_pair,
    sequences,
)
from actorcore.testing.fa4_stand_in import use_fa4_stand_in
from actorcore.testing.quack_stand_in import use_quack_stand_in
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

NOT_FUSED = {**REFUSED, **{frozenset({"compiled_decoder", other}): "not on a CUDA device"
                           for pair in option_pairs() if "compiled_decoder" in pair
                           for other in pair if other != "compiled_decoder"}}
# The attention backends' options resolve before the compiled decoder's: their refusal comes first.
CPU_REFUSED = {**NOT_FUSED, **backend_refusals(option_pairs(), {
    "torch_varlen": "attention_backend='torch_varlen': the torch_varlen backend runs fp16 / bf16 inputs on CUDA",
    "fa4": "attention_backend='fa4': FA4 runs on CUDA devices only"})}


@pytest.fixture(scope="module")
def models():
    """One tiny model per kind, its own gradient checkpointing on, with its own forward's reference (computed once;
    every case reverts its patch)."""
    undo = use_quack_stand_in()
    built = {}
    for model_type in {model_type_for(pair) for pair in option_pairs()}:
        model = checkpointed(build_tiny_model(model_type, seed=11))
        built[model_type] = (model, own_forward(model, sequences()))
    yield built
    undo()


def _works_or_is_refused(models, pair, refused_pairs):
    model, want = models[model_type_for(pair)]
    refused = refused_pairs.get(frozenset(pair))
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            run_pair(model, pair, sequences(), want, Tolerances(1, 1))
        assert not ac.hf.patch.is_patched(model)
        return
    run_pair(model, pair, sequences(), want,
             Tolerances(TOL["packed_vs_hf_fp32"], TOL["grad_packed_vs_hf_fp32_rel"]))


@pytest.mark.parametrize("pair", option_pairs(), ids="+".join)
def test_every_pair_works_as_asked_or_is_refused(models, pair):
    _works_or_is_refused(models, pair, CPU_REFUSED)


@pytest.mark.parametrize("pair", [pair for pair in option_pairs() if "fa4" in pair], ids="+".join)
def test_every_fa4_pair_on_its_stand_in(models, pair):
    """``attention_backend="fa4"`` with every other option, FA4's kernels replaced by the stand-in (any device and
    dtype): its custom ops under checkpointing (kept by a selective checkpoint), offload, tiled MLP, recomputed
    norms, the MoE path, quack's gated MLP and a batch-invariant call."""
    stand_in, undo = use_fa4_stand_in()
    try:
        _works_or_is_refused(models, pair, NOT_FUSED)
        assert frozenset(pair) in NOT_FUSED or stand_in.calls, "the FA4 stand-in never ran"
    finally:
        undo()


def test_the_plan_shows_every_choice_and_why_and_verify_reports_it():
    model = build_tiny_model("qwen2", seed=1)
    handle = ac.patch_model(model, tiled_mlp_shards=2, checkpointing="selective")
    text = str(handle.plan)
    for option in ("parallel", "attention", "tiled_mlp_shards", "offload_activations", "recompute_norms",
                   "checkpointing", "compiled_decoder", "moe_experts", "swiglu_mlp"):
        assert f"\n  {option}: " in text, option
    assert "tiled_mlp_shards: 2 on 2 layers (tiled_mlp_shards=2, asked by patch_model)" in text
    assert "compiled_decoder: False (compiled_decoder='auto', default): auto: the model is not on a CUDA device" in text
    assert handle.plan["checkpointing"].explicit and not handle.plan["swiglu_mlp"].explicit
    report = ac.verify(model, ac.pack(sequences()))
    assert report.ok and report.plan == text and "patched" in report.summary()
    assert handle.calls and handle.calls[-1].ran[0] == "packed_attention"  # verify's call (no grad: no checkpointing)
    handle.revert()
    assert ac.verify(model, ac.pack(sequences())).plan is None


def test_misspelt_or_unknown_keywords_fail_loudly():
    model = build_tiny_model("qwen2")
    with pytest.raises(TypeError, match="unexpected keyword argument 'fused_decodr'; did you mean 'compiled_decoder'"):
        ac.patch_model(model, fused_decodr=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'speed'"):
        ac.patch_model(model, speed="max")
    assert not ac.hf.patch.is_patched(model)
    plan = ac.hf.patch.plan_patch(model, recompute_norms=True)  # the plan alone: nothing installed
    assert plan.value("recompute_norms") is True and not ac.hf.patch.is_patched(model)


# --- the interactions that used to drop or weaken what was asked -------------------------------------------------

@pytest.fixture
def fusable(monkeypatch):
    """The compiled decoder's CUDA / 16-bit refusal lifted (its plan on the CPU; nothing here runs it)."""
    monkeypatch.setattr(compiled_decoder, "compile_refusal", lambda model: None)
    return monkeypatch


def _train_step(model, trace):
    out = ac.compute_logprobs(model, ac.pack(sequences()), temperature=0.9, trace=trace)
    out.log_probs.sum().backward()
    model.zero_grad(set_to_none=True)


def test_compiled_layers_offload_and_selective_checkpointing_are_refused_together(fusable):
    """A compiled layer is not checkpointed selectively (its compiled graph keeps its own tensors), so offload had
    nothing to move and the offload check passed: refused now, naming both options and what to pass."""
    model = checkpointed(build_tiny_model("qwen2"))
    with pytest.raises(ValueError, match=r"compiled_decoder=True and checkpointing='selective', memory_budget_gib=None "
                                         r"cannot both hold: a compiled layer is not checkpointed selectively.*pass "
                                         r"checkpointing='auto'"):
        ac.patch_model(model, compiled_decoder=True, offload_activations=True, checkpointing="selective")
    assert not ac.hf.patch.is_patched(model)


def test_selective_checkpointing_checkpoints_every_layer_selectively(fusable):
    """``checkpointing="selective"`` with the compiled decoder left to ``"auto"``: every layer is selectively
    checkpointed (the compiled decoder yields, and the plan says why); it used to leave the compiled layers unchecked."""
    model = build_tiny_model("qwen2").train()
    handle = ac.patch_model(model, checkpointing="selective")
    trace = Counter()
    _train_step(model, trace)
    layers = model.config.num_hidden_layers
    assert trace[SELECTIVE_LAYERS] == layers and trace[UNCHECKPOINTED_LAYERS] == 0 and trace[FULL_LAYERS] == 0
    assert handle.plan["compiled_decoder"].value is False
    assert "checkpointing='selective'" in handle.plan["compiled_decoder"].why
    handle.revert()


def test_offload_under_a_budget_moves_every_layer_it_asks_for(fusable):
    """``checkpointing="auto"`` keeps layers selectively (still checkpointed: their inputs offload); a compiled layer
    it keeps is kept whole (no checkpointed input), so the budget keeps no compiled layer among the first K offloaded,
    and a compiled decoder with every layer offloaded under a budget is refused."""
    from actorcore.hf.features.checkpointing import CallShape, CheckpointPlan, plan_layer_modes

    model = checkpointed(build_tiny_model("qwen2", num_hidden_layers=4))
    with pytest.raises(ValueError, match=r"compiled_decoder=True and offload_activations=True cannot both hold: under "
                                         r"checkpointing='auto' a compiled layer .*pass offload_activations='auto'"
                                         r".*offload_activations=K"):
        ac.hf.patch.plan_patch(model, compiled_decoder=True, offload_activations=True, checkpointing="auto",
                               memory_budget_gib=1e3)
    roomy = CheckpointPlan("auto", 1e15)
    config = model.config
    assert plan_layer_modes(roomy, [True] * 4, CallShape(10, 2, 0), config, offloaded=2) == ["full", "full", "none", "none"]
    assert plan_layer_modes(roomy, [False] * 4, CallShape(10, 2, 0), config, offloaded=4) == ["selective"] * 4
    fusable.undo()  # on the CPU: the eager decoder, every layer kept selectively and offloaded
    handle = ac.patch_model(model, offload_activations=True, checkpointing="auto", memory_budget_gib=1e3)
    trace = Counter()
    _train_step(model, trace)
    assert trace["offload:layers"] == 4 and trace[SELECTIVE_LAYERS] == 4 and trace["checkpoint:selective"] == 4
    handle.revert()


def test_memory_options_that_leave_the_compiled_decoder_off_say_so_in_the_plan(fusable):
    """Offload of fixed layers, recomputed norms and tiled MLP keep ``"auto"``'s compiled decoder off (not measured
    together; ``offload_activations="auto"`` was), and with
    it the MoE path and quack's gated MLP that follow it: every such choice is in the plan with its reason (they
    were log lines only); ``True`` fuses anyway."""
    undo = use_quack_stand_in()
    try:
        for model_type, followers in (("qwen2", ("swiglu_mlp",)), ("qwen2_moe", ("moe_experts", "swiglu_mlp"))):
            model = checkpointed(build_tiny_model(model_type))
            asks = [{"offload_activations": True}, {"recompute_norms": True}]
            if model_type == "qwen2":
                asks.append({"tiled_mlp_shards": 2})
            for ask in asks:
                plan = ac.hf.patch.plan_patch(model, **ask)
                assert plan.value("compiled_decoder") is False and "has not been measured" in plan["compiled_decoder"].why
                for follower in followers:
                    assert plan.value(follower) is False and "not compiled" in plan[follower].why, (ask, follower)
                assert ac.hf.patch.plan_patch(model, compiled_decoder=True, **ask).value("compiled_decoder") is True
            plain = ac.hf.patch.plan_patch(model)
            assert plain.value("compiled_decoder") is True
            assert all(plain.value(f) for f in followers), str(plain)
            # offload of the layers the budget fully checkpoints: measured with the compiled decoder, which "auto" keeps
            follows = ac.hf.patch.plan_patch(model, offload_activations="auto", checkpointing="auto",
                                             memory_budget_gib=40)
            assert follows.value("compiled_decoder") is True and follows.value("offload_activations") == "auto"
    finally:
        undo()


def test_a_batch_invariant_call_stands_quack_mlps_down():
    """quack's GEMMs are not proven row-count invariant: a batch-invariant call on a model patched with
    ``swiglu_mlp="quack"`` runs the model's own MLP code through the invariant linears (every linear of every layer
    must run invariant), and the trace says the path stood down; it used to run quack's path and pass the check on
    the attention's linears alone."""
    undo = use_quack_stand_in()
    try:
        model = build_tiny_model("qwen2")
        handle = ac.patch_model(model, swiglu_mlp="quack", tiled_mlp_shards=2)
        trace = Counter()
        with torch.no_grad():
            out = ac.compute_logprobs(model, ac.pack(sequences()), batch_invariant=True, trace=trace)
            alone = ac.compute_logprobs(model, ac.pack(sequences()[:1]), batch_invariant=True).log_probs
        # q, k, v, o once per layer; gate, up and down once per tiled MLP shard (2)
        assert trace["batch_invariant:linear"] == (4 + 3 * 2) * model.config.num_hidden_layers
        assert trace["swiglu_mlp:modules"] == 0 and trace["plan:stood_down:swiglu_mlp"] == 1
        assert torch.equal(alone, out.log_probs[:len(sequences()[0])])
        assert handle.plan.stands_down_in_batch_invariant_calls() == ("swiglu_mlp",)
        assert handle.calls[-1].stood_down == ("swiglu_mlp",)
        trace = Counter()
        with torch.no_grad():
            ac.compute_logprobs(model, ac.pack(sequences()), trace=trace)  # an ordinary call: quack's path again
        assert trace["swiglu_mlp:modules"] == 2 * model.config.num_hidden_layers  # once per tiled MLP shard
        handle.revert()
    finally:
        undo()


def test_verl_states_its_plan_and_takes_the_options():
    """verl's entry point asks for each option it turns off, with its reason in the plan (the MLP path no longer
    follows the compiled decoder's default), and passes any ``patch_model`` option through."""
    from actorcore.compat.verl import apply_monkey_patch

    undo = use_quack_stand_in()
    try:
        model = build_tiny_model("qwen2")
        handle = apply_monkey_patch(model, use_fused_kernels=True)
        for option in ("compiled_decoder", "moe_experts", "swiglu_mlp"):
            decision = handle.plan[option]
            assert decision.value is False and decision.explicit and decision.by == "compat.verl", option
            assert "verl" in decision.why, option
        handle.revert()
        handle = apply_monkey_patch(model, use_fused_kernels=True, checkpointing="selective", swiglu_mlp="quack")
        assert handle.plan.value("swiglu_mlp") == "quack" and handle.plan["checkpointing"].explicit
        model.train()
        out = model(input_ids=sequences()[0][None], position_ids=torch.arange(len(sequences()[0]))[None])
        out.log_probs.sum().backward()
        assert {"checkpointing", "swiglu_mlp"} <= set(handle.calls[-1].ran)
        handle.revert()
        with pytest.raises(TypeError, match="did you mean 'checkpointing'"):
            apply_monkey_patch(model, checkpointng="selective")
    finally:
        undo()
