"""patch_model hygiene: per instance, refuses to stack, reverts exactly, checks that it took effect, refuses
configurations it cannot honour with clear errors, and does nothing on import."""

import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import actorcore as ac
from actorcore.hf.patch import PatchNotAppliedError, require_sequence_parallel_patch
from actorcore.hf.features.tiled_mlp import TILED_MLP_KEY
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL


def _batch():
    g = torch.Generator().manual_seed(3)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (40, 9, 27)])


def _fake_sp(size):
    """Stands in for a ParallelContext at patch time (patching issues no collective)."""
    return SimpleNamespace(sp_size=size, sp_group=object(), sp_rank=0)


def _state(model):
    """Everything a patch may replace: instance forwards and the configs' attention implementation."""
    mlps = {n: dict(m.__dict__).get("forward") for n, m in model.named_modules()}
    configs = {id(c): c.__dict__.get("_attn_implementation_internal")
               for c in {id(layer.self_attn.config): layer.self_attn.config for layer in model.model.layers}.values()}
    hooks = (dict(model.model._forward_hooks), dict(model.model._forward_pre_hooks))
    return mlps, configs, hooks


def test_patching_twice_is_an_error_and_revert_restores_exactly():
    model = build_tiny_model("llama")
    before = _state(model)
    handle = ac.patch_model(model, tiled_mlp_shards=3)
    assert _state(model) != before
    with pytest.raises(ValueError, match="already patched"):
        ac.patch_model(model, tiled_mlp_shards=2)
    handle.revert()
    assert _state(model) == before
    with pytest.raises(ValueError, match="already reverted"):
        handle.revert()
    ac.patch_model(model, parallel=_fake_sp(2)).revert()  # patchable again after revert
    assert _state(model) == before


def test_sequence_parallel_patch_sets_and_restores_attention():
    model = build_tiny_model("qwen3", attn_implementation="sdpa")
    handle = ac.patch_model(model, parallel=_fake_sp(2))
    assert {layer.self_attn.config._attn_implementation for layer in model.model.layers} == {"actorcore_ulysses"}
    handle.revert()
    assert model.config._attn_implementation == "sdpa"


def test_two_instances_patched_differently():
    batch = _batch()
    actor, reference = build_tiny_model("llama", seed=1), build_tiny_model("llama", seed=1)
    ac.patch_model(actor, tiled_mlp_shards=2)
    ref = ac.compute_logprobs(reference, batch)
    trace = Counter()
    out = ac.compute_logprobs(actor, batch, trace=trace)
    assert trace[TILED_MLP_KEY] == actor.config.num_hidden_layers
    assert (out.log_probs - ref.log_probs).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert (out.entropy - ref.entropy).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert "forward" not in reference.model.layers[0].mlp.__dict__


def test_tiled_mlp_patch_gradients_match_unpatched():
    batch = _batch()
    actor, reference = build_tiny_model("gemma2", seed=2), build_tiny_model("gemma2", seed=2)
    ac.patch_model(actor, tiled_mlp_shards=3)
    for model in (actor, reference):
        out = ac.compute_logprobs(model, batch)
        (out.log_probs.sum() + out.entropy.sum()).backward()
    for (name, p), (_, q) in zip(actor.named_parameters(), reference.named_parameters()):
        rel = ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
        assert rel <= TOL["grad_packed_vs_hf_fp32_rel"], f"{name}: {rel:.1e}"


def test_self_check_fires_when_the_patch_is_bypassed():
    model = build_tiny_model("llama")
    ac.patch_model(model, tiled_mlp_shards=2)
    del model.model.layers[1].mlp.__dict__["forward"]  # as if a new transformers called another forward
    with pytest.raises(PatchNotAppliedError, match=r"did not take effect.*tiled MLP ran 1 times"):
        ac.compute_logprobs(model, _batch())


def test_refused_configurations():
    with pytest.raises(ValueError, match="mixture of experts"):
        ac.patch_model(build_tiny_model("qwen3_moe"), tiled_mlp_shards=2)
    model = build_tiny_model("llama")  # 4 heads, 2 kv heads
    before = _state(model)
    with pytest.raises(ValueError, match=r"sp_size=3.*Valid sp sizes for this model: \[1, 2, 4\]"):
        ac.patch_model(model, parallel=_fake_sp(3))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="tiled_mlp_shards must be a positive int"):
            ac.patch_model(model, tiled_mlp_shards=bad)
    with pytest.raises(ValueError, match="ParallelContext"):
        ac.patch_model(model, parallel="sp")
    assert _state(model) == before, "a refused patch must leave nothing behind"
    ac.patch_model(model, parallel=_fake_sp(4)).revert()


def test_models_sharing_a_config_are_refused():
    from transformers import AutoModelForCausalLM

    first = build_tiny_model("llama")
    second = AutoModelForCausalLM.from_config(first.config, attn_implementation="eager")
    ac.patch_model(first, parallel=_fake_sp(2))
    with pytest.raises(ValueError, match="shares its config object"):
        ac.patch_model(second, parallel=_fake_sp(2))


def test_sequence_parallel_call_requires_the_matching_patch():
    model = build_tiny_model("llama")
    ctx = _fake_sp(2)
    with pytest.raises(ValueError, match="not patched for sequence parallelism"):
        require_sequence_parallel_patch(model, ctx)
    ac.patch_model(model, parallel=ctx)
    require_sequence_parallel_patch(model, ctx)
    require_sequence_parallel_patch(model, _fake_sp(2))  # the group comes with each call; the size must match
    with pytest.raises(ValueError, match="patched for sp_size=2 but parallel= has sp_size=4"):
        require_sequence_parallel_patch(model, _fake_sp(4))


def test_nothing_happens_on_import():
    code = (
        "import actorcore, actorcore.hf.patch, actorcore.compat.verl, actorcore.parallel\n"
        "from transformers import AttentionInterface\n"
        "assert not [k for k in AttentionInterface._global_mapping if k.startswith('actorcore')], "
        "AttentionInterface._global_mapping.keys()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copy_of_a_patched_model_computes_with_its_own_weights(how):
    """``ref = copy.deepcopy(actor)`` is routine in RL: the copy must run its own weights, not the original's."""
    from support.copies import copy_model, scale_weights_of_copy_and_twin

    batch = _batch()
    actor = build_tiny_model("llama", seed=2)
    ac.patch_model(actor, tiled_mlp_shards=2)
    clone = copy_model(actor, how)
    expected = scale_weights_of_copy_and_twin(clone, lambda: build_tiny_model("llama", seed=2))
    trace = Counter()
    out = ac.compute_logprobs(clone, batch, trace=trace)
    want = ac.compute_logprobs(expected, batch)
    assert (out.log_probs - want.log_probs).abs().max().item() <= TOL["packed_vs_hf_fp32"]
    assert trace[TILED_MLP_KEY] == 2, "the copy runs its tiled MLP"
    assert all(layer.mlp.forward.mlp is layer.mlp for layer in clone.model.layers), "the copy's forwards hold its MLPs"
    assert clone.model.layers[0].mlp.forward.trace is not actor.model.layers[0].mlp.forward.trace
    out.log_probs.sum().backward()
    assert all(p.grad is None for p in actor.parameters()), "gradient reached the original's weights"
    assert all(p.grad is not None for p in clone.model.layers[0].mlp.parameters())
