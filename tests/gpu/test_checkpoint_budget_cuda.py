"""CUDA: ``checkpointing="auto"`` plans its first call from the config's estimate and measures what each kept
(fused) layer holds; the next call plans with the measurement, keeps more layers in the same budget, and its
peak stays within it. Skipped without CUDA / triton."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.testing.tiny_configs import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_auto_plans_with_the_measured_layers_within_the_budget():
    pytest.importorskip("triton")
    from actorcore.hf.features.checkpointing import (FULL_LAYERS, UNCHECKPOINTED_LAYERS, gradients_to_come,
                                                     layer_bytes_per_token)
    from actorcore.hf.patch import patch_state

    model = build_tiny_model("llama", seed=0, dtype=torch.bfloat16, hidden_size=1024, intermediate_size=2816,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_hidden_layers=8,
                             vocab_size=4096).cuda().train()
    config, layers = model.config, model.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    batch = ac.pack([torch.randint(3, 4096, (int(n),), generator=g)
                     for n in torch.randint(300, 1500, (16,), generator=g)]).to("cuda")
    tokens = batch.num_tokens
    estimate, checkpointed_input = layer_bytes_per_token(config, 2, fused=True)
    allocated = torch.cuda.memory_allocated()
    # Room for 4.8 estimated layers: the estimate keeps 3 (3 + the gradients of one), a measurement under 0.95 of
    # it keeps 4; and for the weight gradients the last layer's backward allocates (each call's: set to None after).
    grads, head_grad = gradients_to_come(model, list(model.model.layers))
    budget = (allocated + layers * checkpointed_input * tokens + 2**30 + 4.8 * estimate * tokens + grads[-1]
              + head_grad)
    # quack's gated MLP off: layers kept whole or fully checkpointed (its "gate_up" way: test_gate_up_recompute_cuda)
    handle = ac.patch_model(model, checkpointing="auto", memory_budget_gib=budget / 2**30, swiglu_mlp=False)

    def step():
        trace = Counter()
        out = ac.compute_logprobs(model, batch, trace=trace)
        (-(out.log_probs * torch.linspace(0.5, 1.5, tokens, device="cuda")).sum()).backward()
        model.zero_grad(set_to_none=True)
        return trace

    first = step()
    assert first[UNCHECKPOINTED_LAYERS] == 3 and first[FULL_LAYERS] == layers - 3
    measured = patch_state(model).measured_layer_bytes
    assert measured.keys() == {(i, "none") for i in range(layers - 3, layers)}
    for value in measured.values():  # the estimate errs on the safe side, not by more than 2x
        assert 0.5 * estimate < value < 0.95 * estimate, (value, estimate)
    torch.cuda.reset_peak_memory_stats()
    second = step()
    assert second[UNCHECKPOINTED_LAYERS] == 4 and second[FULL_LAYERS] == layers - 4
    assert torch.cuda.max_memory_allocated() <= budget
    handle.revert()


def test_auto_offload_keeps_layers_the_inputs_on_the_device_would_not_fit():
    """``offload_activations="auto"``: the compiled decoder's fully checkpointed (leading) layers send their inputs
    to pinned host memory, and the plan counts them off the device. A budget in which every input on the device
    leaves no room for a layer's recompute keeps two layers this way, in both calls (estimated, then measured);
    the peak stays within it and the offloaded layers are the fully checkpointed ones."""
    pytest.importorskip("triton")
    from actorcore.hf.features.checkpointing import FULL_LAYERS, UNCHECKPOINTED_LAYERS, layer_bytes_per_token
    from actorcore.hf.features.compiled_decoder import CHECKPOINTED_IN_GRAPH_KEY

    # Many layers of a narrow MLP: the checkpointed inputs weigh as much as a kept layer.
    model = build_tiny_model("llama", seed=0, dtype=torch.bfloat16, hidden_size=1024, intermediate_size=1024,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_hidden_layers=16,
                             vocab_size=4096).cuda().train()
    layers = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    batch = ac.pack([torch.randint(3, 4096, (int(n),), generator=g)
                     for n in torch.randint(300, 1500, (16,), generator=g)]).to("cuda")
    tokens = batch.num_tokens
    kept, inp = (b * tokens for b in layer_bytes_per_token(model.config, 2, fused=True))
    for param in model.parameters():  # later micro-batches: the gradients are there
        param.grad = torch.zeros_like(param)
    # Two inputs under way, two kept layers with their inputs and the last one's gradients; every input on the
    # device leaves under 3 kept layers of room.
    budget = torch.cuda.memory_allocated() + 2**30 + 2 * inp + 2 * (kept + inp) + 1.05 * kept
    assert budget - torch.cuda.memory_allocated() - 2**30 - layers * inp < 3 * kept
    # quack's gated MLP off: layers kept whole or fully checkpointed
    handle = ac.patch_model(model, compiled_decoder=True, checkpointing="auto", memory_budget_gib=budget / 2**30,
                            offload_activations="auto", swiglu_mlp=False)
    for call in ("estimated", "measured"):
        trace = Counter()
        torch.cuda.reset_peak_memory_stats()
        out = ac.compute_logprobs(model, batch, trace=trace)
        (-(out.log_probs * torch.linspace(0.5, 1.5, tokens, device="cuda")).sum()).backward()
        assert trace[UNCHECKPOINTED_LAYERS] >= 2, (call, dict(trace))
        assert trace["offload:layers"] == trace[FULL_LAYERS] == layers - trace[UNCHECKPOINTED_LAYERS], dict(trace)
        # checkpointed inside their compiled graphs, each moving its input alone (not the weights saved beside it)
        assert trace[CHECKPOINTED_IN_GRAPH_KEY] == trace["offload:tensors"] == trace[FULL_LAYERS], dict(trace)
        assert torch.cuda.max_memory_allocated() <= budget, call
    handle.revert()
