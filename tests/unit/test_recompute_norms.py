"""``patch_model(recompute_norms=True)``: the decoder's norms keep only their input for backward and run again
there. Against the same model unpatched: bitwise the same log-probs, entropies and every gradient (bf16, with and
without gradient checkpointing, composed with tiled MLP and offload); fewer bytes saved for backward (counted by
a saved-tensors hook); the patch ran (its self-check), reverts, survives ``copy.deepcopy`` with the copy's
weights, refuses batch-invariant mode, and raises when transformers bypasses it."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from support.decoder_steps import assert_bitwise, seeded_batch, train_step

import actorcore as ac
from actorcore.hf.features.norm_recompute import NORM_FORWARD_KEY, NORM_RUN_KEY, RecomputedNormForward, decoder_norms
from actorcore.hf.patch import PatchNotAppliedError
from actorcore.testing.tiny_configs import build_tiny_model, checkpointed


def _saved_bytes(model, batch) -> int:
    """Bytes autograd keeps for backward during one training forward (no checkpointing: all of them)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = ac.compute_logprobs(model, batch)
    out.log_probs.sum().backward()
    model.zero_grad(set_to_none=True)
    return total


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "qwen3_5_text"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_bitwise_the_same_and_the_norms_ran(model_type, checkpointing, monkeypatch):
    calls, runs, in_backward = Counter(), Counter(), Counter()  # per norm forward object (id)
    call, run = RecomputedNormForward.__call__, RecomputedNormForward._run

    def counting_call(self, *args, **kwargs):
        calls[id(self)] += 1
        return call(self, *args, **kwargs)

    def counting_run(self, *args, **kwargs):
        runs[id(self)] += 1
        in_backward[id(self)] += torch._C._current_graph_task_id() != -1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(RecomputedNormForward, "__call__", counting_call)
    monkeypatch.setattr(RecomputedNormForward, "_run", counting_run)
    model = build_tiny_model(model_type, seed=3, dtype=torch.bfloat16)
    model = checkpointed(model) if checkpointing else model.train()
    batch = seeded_batch()
    plain = train_step(model, batch, Counter())
    model.zero_grad(set_to_none=True)
    handle = ac.patch_model(model, recompute_norms=True)
    forwards = [norm.forward for norm in decoder_norms(model.model)]
    assert forwards and all(isinstance(f, RecomputedNormForward) for f in forwards)
    trace = Counter()
    patched = train_step(model, batch, trace)
    assert_bitwise(plain, patched)
    # Every norm ran in the forward and again inside backward, recomputed from its kept input. In a checkpointed
    # layer the layer's own recomputation (inside backward too) runs it once more, unless that recomputation
    # stops early, at the norm's kept input, when the norm ends the layer (gemma3's post-feedforward norm).
    counts = [(calls[id(f)], runs[id(f)], in_backward[id(f)]) for f in forwards]
    if checkpointing:
        assert all(runs[id(f)] >= 2 and in_backward[id(f)] == runs[id(f)] - 1 for f in forwards), counts
    else:
        assert all(c == (1, 2, 1) for c in counts), counts
    # The call's trace counts the same: every forward asked for, every computation (recomputations included).
    assert (trace[NORM_FORWARD_KEY], trace[NORM_RUN_KEY]) == (sum(calls.values()), sum(runs.values())), counts
    handle.revert()
    assert not any("forward" in norm.__dict__ for norm in decoder_norms(model.model))


def test_norms_keep_less_for_backward():
    """bf16 Llama: each norm kept an fp32 copy of its input (4 bytes per element) and its bf16 normalised values
    (2); recomputed it keeps its bf16 input (2)."""
    model = build_tiny_model("llama", seed=3, dtype=torch.bfloat16).train()
    batch = seeded_batch()
    before = _saved_bytes(model, batch)
    handle = ac.patch_model(model, recompute_norms=True)
    after = _saved_bytes(model, batch)
    handle.revert()
    norms = 2 * model.config.num_hidden_layers + 1
    per_norm = batch.num_tokens * model.config.hidden_size * 4  # fp32 copy + normalised - kept input
    assert before - after >= norms * per_norm, (before, after)


def test_composes_with_tiled_mlp_and_offload():
    model = checkpointed(build_tiny_model("qwen3", seed=4, dtype=torch.bfloat16))
    batch = seeded_batch()
    handle = ac.patch_model(model, tiled_mlp_shards=3, offload_activations=True)
    plain = train_step(model, batch, Counter())
    handle.revert()
    model.zero_grad(set_to_none=True)
    handle = ac.patch_model(model, tiled_mlp_shards=3, offload_activations=True, recompute_norms=True)
    trace = Counter()
    patched = train_step(model, batch, trace)
    handle.revert()
    assert_bitwise(plain, patched)
    assert trace["offload:layers"] == model.config.num_hidden_layers


def test_a_deep_copy_recomputes_its_own_norms():
    model = build_tiny_model("llama", seed=5).train()
    handle = ac.patch_model(model, recompute_norms=True)
    twin = copy.deepcopy(model)
    assert twin.model.norm.forward.norm is twin.model.norm
    with torch.no_grad():
        twin.model.norm.weight.mul_(3.0)
    batch = seeded_batch()
    moved = ac.compute_logprobs(twin, batch).log_probs
    handle.revert()
    reference = build_tiny_model("llama", seed=5)
    with torch.no_grad():
        reference.model.norm.weight.mul_(3.0)
    assert torch.equal(moved, ac.compute_logprobs(reference, batch).log_probs)


def test_refuses_batch_invariant_and_a_bypass():
    model = build_tiny_model("llama", seed=6).train()
    handle = ac.patch_model(model, recompute_norms=True)
    with pytest.raises(ValueError, match="recompute_norms"):
        ac.compute_logprobs(model, seeded_batch(), batch_invariant=True)
    plain = type(model.model.norm).forward.__get__(model.model.norm)
    model.model.norm.__dict__["forward"] = plain  # as if transformers called the norm some other way
    with pytest.raises(PatchNotAppliedError, match="recomputed norms"):
        ac.compute_logprobs(model, seeded_batch())
    handle.revert()
    with pytest.raises(ValueError, match="recompute_norms must be True or False"):
        ac.patch_model(model, recompute_norms="yes")
