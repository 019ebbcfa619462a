"""Activation offload on the CPU: the mechanics (each checkpointed layer's input, and only it, leaves through the
hooks and comes back, the layer before prefetched) and exactness (log-probs, entropies and every parameter
gradient bitwise those of the same checkpointed model without offload), with tiled MLP, a hybrid model, the
loss-fused head, copies of the model, and loud failures when checkpointing does not run."""

import copy
import functools
from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.hf.offload import (
    OFFLOAD_BYTES,
    OFFLOAD_LAYERS,
    OFFLOAD_PREFETCHED,
    OFFLOAD_RESTORED,
    OFFLOAD_TENSORS,
)
from actorcore.hf.patch import PatchNotAppliedError
from actorcore.testing.tiny_configs import build_tiny_model

LENGTHS = (40, 9, 27, 1)


def _batch():
    g = torch.Generator().manual_seed(5)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in LENGTHS])


def checkpointed(model, reentrant=False):
    """Gradient checkpointing on every layer, in training mode (5.24 renamed the method; 5.17 has only the old)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()


def _train_step(model, batch, trace):
    out = ac.compute_logprobs(model, batch, temperature=0.9, trace=trace)
    weights = torch.linspace(0.5, 1.5, out.log_probs.numel())
    (-(out.log_probs * weights).sum() - 0.1 * out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


def _assert_bitwise(a, b):
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = a, b
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def _assert_moved_and_restored(trace, model, tokens):
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    itemsize = next(model.parameters()).element_size()
    assert trace[OFFLOAD_LAYERS] == layers
    assert trace[OFFLOAD_TENSORS] == layers, "exactly one tensor per layer (its input hidden states) moves"
    assert trace[OFFLOAD_BYTES] == layers * tokens * hidden * itemsize
    assert trace[OFFLOAD_RESTORED] == layers
    assert trace[OFFLOAD_PREFETCHED] == layers - 1, "every layer but the last came back ahead of its recompute"


@pytest.mark.parametrize("model_type, shards", [("llama", 3), ("qwen3_5_text", None)])
def test_offload_is_bitwise_and_moves_each_layer_input(model_type, shards):
    batch = _batch()
    plain = checkpointed(build_tiny_model(model_type, seed=4))
    offloaded = checkpointed(build_tiny_model(model_type, seed=4))
    ac.patch_model(plain, tiled_mlp_shards=shards)
    ac.patch_model(offloaded, tiled_mlp_shards=shards, offload_activations=True)
    want = _train_step(plain, batch, Counter())
    trace = Counter()
    _assert_bitwise(_train_step(offloaded, batch, trace), want)
    _assert_moved_and_restored(trace, offloaded, batch.num_tokens)
    if shards is not None:
        assert all(layer.mlp.forward.calls == 2 for layer in offloaded.model.layers)  # forward + recompute


def _ppo(logprob, entropy, advantages, old_logprob):
    ratio = torch.exp(logprob - old_logprob)
    return -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages) - 0.01 * entropy


def test_loss_fused_head_copies_and_revert():
    batch = _batch()
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
        _assert_bitwise(step(m, trace), want)
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
        ac.compute_logprobs(model, _batch(), trace=trace)
    assert not any(k.startswith("offload:") for k in trace)


def test_offload_refuses_or_fails_loudly_without_checkpointing():
    with pytest.raises(ValueError, match="decoder layer 0 of LlamaForCausalLM is not checkpointed"):
        ac.patch_model(build_tiny_model("llama"), offload_activations=True)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        ac.patch_model(checkpointed(build_tiny_model("llama"), reentrant=True), offload_activations=True)
    with pytest.raises(ValueError, match="offload_activations must be True or False"):
        ac.patch_model(checkpointed(build_tiny_model("llama")), offload_activations=1)

    model = checkpointed(build_tiny_model("llama"))
    ac.patch_model(model, offload_activations=True)
    model.eval()  # transformers checkpoints only in training mode: nothing would be offloaded
    with pytest.raises(PatchNotAppliedError, match=r"ran in 0 of 2 decoder layers.*model.training=False"):
        ac.compute_logprobs(model, _batch())
    model.train()
    layer = model.model.layers[1]  # as if a new transformers called this layer without its checkpoint function
    layer.forward = functools.partial(type(layer).forward.__wrapped__, layer)
    with pytest.raises(PatchNotAppliedError, match=r"ran in 1 of 2 decoder layers"):
        ac.compute_logprobs(model, _batch())
    del layer.forward
    model.model.layers[0].gradient_checkpointing = False  # switched off after patching: refused at the call
    with pytest.raises(ValueError, match="decoder layer 0 .* is not checkpointed"):
        ac.compute_logprobs(model, _batch())
