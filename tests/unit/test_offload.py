"""Activation offload on the CPU: the mechanics (each checkpointed layer's input, and only it, leaves through the
hooks and comes back, the layer before prefetched) and exactness (log-probs, entropies and every parameter
gradient bitwise those of the same checkpointed model without offload), with tiled MLP, a hybrid model, the
loss-fused head, copies of the model, partial offload (the first K layers), host blocks reused across calls and
freed on revert, nothing left installed after an interrupted forward or backward, and loud failures when
checkpointing does not run."""

import copy
import functools
import gc
from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.hf.features.offload import (
    OFFLOAD_BYTES,
    OFFLOAD_HOST_ALLOCATED,
    OFFLOAD_KEPT,
    OFFLOAD_LAYERS,
    OFFLOAD_PREFETCHED,
    OFFLOAD_RESTORED,
    OFFLOAD_TENSORS,
    POOL,
    host_bytes,
)
from actorcore.hf.patch import PatchNotAppliedError
from actorcore.testing.tiny_configs import build_tiny_model, checkpointed
from support.decoder_steps import assert_bitwise, seeded_batch, train_step


def _assert_moved_and_restored(trace, model, tokens, offloaded=None):
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    offloaded = layers if offloaded is None else offloaded
    itemsize = next(model.parameters()).element_size()
    assert trace[OFFLOAD_LAYERS] == offloaded and trace[OFFLOAD_KEPT] == layers - offloaded
    assert trace[OFFLOAD_TENSORS] == offloaded, "exactly one tensor per layer (its input hidden states) moves"
    assert trace[OFFLOAD_BYTES] == offloaded * tokens * hidden * itemsize
    assert trace[OFFLOAD_RESTORED] == offloaded
    # Every offloaded layer came back ahead of its recompute but the last in forward order when all offload (the
    # first that backward reaches); with a kept layer after it, that one's recompute starts its copy.
    assert trace[OFFLOAD_PREFETCHED] == (offloaded - 1 if offloaded == layers else offloaded)


@pytest.mark.parametrize("model_type, shards", [("llama", 3), ("qwen3_5_text", None)])
def test_offload_is_bitwise_and_moves_each_layer_input(model_type, shards):
    batch = seeded_batch()
    plain = checkpointed(build_tiny_model(model_type, seed=4))
    offloaded = checkpointed(build_tiny_model(model_type, seed=4))
    ac.patch_model(plain, tiled_mlp_shards=shards)
    ac.patch_model(offloaded, tiled_mlp_shards=shards, offload_activations=True)
    want = train_step(plain, batch, Counter())
    trace = Counter()
    assert_bitwise(train_step(offloaded, batch, trace), want)
    _assert_moved_and_restored(trace, offloaded, batch.num_tokens)
    if shards is not None:
        assert trace["tiled_mlp:forward"] == 2 * len(offloaded.model.layers)  # forward + recompute


def _ppo(logprob, entropy, advantages, old_logprob):
    ratio = torch.exp(logprob - old_logprob)
    return -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages) - 0.01 * entropy


def test_loss_fused_head_copies_and_revert():
    batch = seeded_batch()
    g = torch.Generator().manual_seed(6)
    args = (torch.randn(batch.num_real_tokens, generator=g), -torch.rand(batch.num_real_tokens, generator=g) * 5)
    plain = checkpointed(build_tiny_model("qwen2", seed=8))
    model = checkpointed(build_tiny_model("qwen2", seed=8))
    handle = ac.patch_model(model, offload_activations=True)
    twin = copy.deepcopy(model)  # carries the flag; computes with its own weights

    def step(m, trace):
        out = ac.compute_loss(m, batch, _ppo, token_args=args, trace=trace)
        out.loss.backward()
        return out.logprob, out.entropy, {n: p.grad.clone() for n, p in m.named_parameters()}

    want = step(plain, Counter())
    for m in (model, twin):
        trace = Counter()
        assert_bitwise(step(m, trace), want)
        _assert_moved_and_restored(trace, m, batch.num_tokens)
    handle.revert()
    trace = Counter()
    ac.compute_loss(model, batch, _ppo, token_args=args, trace=trace).loss.backward()
    assert not any(k.startswith("offload:") for k in trace)


def test_no_offload_without_gradients():
    model = checkpointed(build_tiny_model("llama"))
    ac.patch_model(model, offload_activations=True)
    trace = Counter()
    with torch.no_grad():
        ac.compute_logprobs(model, seeded_batch(), trace=trace)
    assert not any(k.startswith("offload:") for k in trace)


def test_offload_refuses_or_fails_loudly_without_checkpointing():
    with pytest.raises(ValueError, match="decoder layer 0 of LlamaForCausalLM is not checkpointed"):
        ac.patch_model(build_tiny_model("llama"), offload_activations=True)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        ac.patch_model(checkpointed(build_tiny_model("llama"), reentrant=True), offload_activations=True)
    for bad, message in ((0, "between 1 and 2 decoder layers"), (3, "between 1 and 2 decoder layers"),
                         (1.5, "True, False, 'auto' or a number of decoder layers"),
                         ("all", "True, False, 'auto' or a number"), ("Auto", "True, False, 'auto' or a number")):
        with pytest.raises(ValueError, match=message):
            ac.patch_model(checkpointed(build_tiny_model("llama")), offload_activations=bad)

    model = checkpointed(build_tiny_model("llama"))
    ac.patch_model(model, offload_activations=True)
    model.eval()  # transformers checkpoints only in training mode: nothing would be offloaded
    with pytest.raises(PatchNotAppliedError, match=r"ran in 0 of 2 decoder layers.*model.training=False"):
        ac.compute_logprobs(model, seeded_batch())
    model.train()
    layer = model.model.layers[1]  # as if a new transformers called this layer without its checkpoint function
    layer.forward = functools.partial(type(layer).forward.__wrapped__, layer)
    with pytest.raises(PatchNotAppliedError, match=r"ran in 1 of 2 decoder layers"):
        ac.compute_logprobs(model, seeded_batch())
    del layer.forward
    model.model.layers[0].gradient_checkpointing = False  # switched off after patching: refused at the call
    with pytest.raises(ValueError, match="decoder layer 0 .* is not checkpointed"):
        ac.compute_logprobs(model, seeded_batch())


def _settled():
    gc.collect()  # graphs of earlier steps dropped: their saved inputs died and gave their host blocks back
    return POOL.in_use_bytes


def test_partial_offload_is_bitwise_and_reuses_host_blocks():
    batch = seeded_batch()
    plain = checkpointed(build_tiny_model("llama", seed=2, num_hidden_layers=3))
    model = checkpointed(build_tiny_model("llama", seed=2, num_hidden_layers=3))
    ac.patch_model(plain)
    handle = ac.patch_model(model, offload_activations=2)
    assert copy.deepcopy(model)._actorcore_patch.value("offload_activations") == 2
    assert _settled() == 0
    block = host_bytes(batch.num_tokens * model.config.hidden_size * 4)
    for step in range(2):
        want = train_step(plain, batch, Counter())
        plain.zero_grad()
        trace = Counter()
        blocks = POOL.allocated_blocks
        assert_bitwise(train_step(model, batch, trace), want)
        model.zero_grad()
        _assert_moved_and_restored(trace, model, batch.num_tokens, offloaded=2)
        assert POOL.in_use_bytes == 0, "the inputs died after their layers' backward: their blocks are idle"
        if step == 0:
            assert POOL.idle_bytes >= 2 * block
        else:  # the second call runs in the first call's blocks
            assert trace[OFFLOAD_HOST_ALLOCATED] == 0 and POOL.allocated_blocks == blocks
    handle.revert()
    assert POOL.idle_bytes == 0, "reverting the offload patch frees the idle host blocks"


def test_auto_offloads_the_layers_the_budget_fully_checkpoints():
    """``offload_activations="auto"`` moves, in each call, the inputs of the leading layers that
    ``checkpointing="auto"`` fully checkpoints, and the plan counts them off the device: a budget that keeps two
    layers only with the others' inputs away. Bitwise the same step; refused without ``checkpointing="auto"``."""
    from actorcore.hf.features.checkpointing import layer_bytes_per_token

    batch = seeded_batch()
    plain = checkpointed(build_tiny_model("llama", seed=3, num_hidden_layers=6))
    model = checkpointed(build_tiny_model("llama", seed=3, num_hidden_layers=6))
    for params in (plain.parameters(), model.parameters()):  # a later micro-batch: every gradient already there
        for param in params:
            param.grad = torch.zeros_like(param)
    kept, inp = (b * batch.num_tokens for b in layer_bytes_per_token(model.config, 4, fused=False))
    # Two inputs under way, two kept layers with their inputs and the second's gradients; with every input on the
    # device (no offload), less than a layer's recompute.
    budget = 2**30 + 2 * inp + 2 * (kept + inp) + kept + 1
    ac.patch_model(plain)
    handle = ac.patch_model(model, checkpointing="auto", memory_budget_gib=budget / 2**30,
                            offload_activations="auto")
    assert handle.plan.value("offload_activations") == "auto"
    assert copy.deepcopy(model)._actorcore_patch.value("offload_activations") == "auto"
    trace = Counter()
    assert_bitwise(train_step(model, batch, trace), train_step(plain, batch, Counter()))
    assert trace["checkpoint:full_layers"] == 4 and trace["checkpoint:selective_layers"] == 2
    assert trace[OFFLOAD_LAYERS] == 4 and trace[OFFLOAD_KEPT] == 2 and trace[OFFLOAD_TENSORS] == 4
    assert trace[OFFLOAD_BYTES] == inp * 4
    handle.revert()
    with pytest.warns(UserWarning, match="cannot be met"):  # the same budget without offload keeps none
        ac.patch_model(model, checkpointing="auto", memory_budget_gib=budget / 2**30)
        trace = Counter()
        train_step(model, batch, trace)
    assert trace["checkpoint:full_layers"] == 6
    for asked in ({}, {"checkpointing": "full"}):
        with pytest.raises(ValueError, match=r"offload_activations='auto' offloads the layers that "
                                             r"checkpointing='auto' fully checkpoints.*pass checkpointing='auto'"):
            ac.patch_model(checkpointed(build_tiny_model("llama")), offload_activations="auto", **asked)


class _InterruptAt:
    """A forward pre-hook raising KeyboardInterrupt at the n-th call of its module (2: the recompute in backward)."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt


@pytest.mark.parametrize("at", [1, 2], ids=["forward", "backward"])
def test_interrupt_leaves_nothing_installed(at):
    batch = seeded_batch()
    plain = checkpointed(build_tiny_model("llama", seed=9))
    model = checkpointed(build_tiny_model("llama", seed=9))
    ac.patch_model(plain)
    ac.patch_model(model, offload_activations=True)
    layers = model.model.layers
    before = [dict(layer.__dict__) for layer in layers]
    attention = [layer.self_attn.config._attn_implementation for layer in layers]
    hook = layers[0].mlp.register_forward_pre_hook(_InterruptAt(at))
    with pytest.raises(KeyboardInterrupt) as interrupted:
        train_step(model, batch, Counter())
    hook.remove()
    del interrupted  # its traceback holds the broken graph
    assert _settled() == 0, "the broken graph's saved inputs gave their host blocks back"
    assert [dict(layer.__dict__) for layer in layers] == before
    assert [layer.self_attn.config._attn_implementation for layer in layers] == attention
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "saved-tensor hooks left in force"
    model.zero_grad(set_to_none=True)
    trace = Counter()
    assert_bitwise(train_step(model, batch, trace), train_step(plain, batch, Counter()))
    _assert_moved_and_restored(trace, model, batch.num_tokens)
