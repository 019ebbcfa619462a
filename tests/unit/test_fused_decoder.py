"""The fused decoder's mechanics (``patch_model(fused_decoder=True)``), run on the CPU with Inductor's C++ kernels in
fp32 (the product enables it only on CUDA for 16-bit models; this test lifts that refusal): per token and per
gradient element against the eager packed path, with layer checkpointing (transformers >= 5.24 checkpoints inside
the class's forward, which the instance forward takes over) and with ``checkpointing="selective"`` (fused layers
not checkpointed); the trace proves the compiled layers ran; a pack of another length compiles nothing new; the
model's own forward stays eager; a deep copy runs its own layers; ``revert`` restores the layers."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from test_offload import _batch, _train_step, checkpointed

import actorcore as ac
import actorcore.hf.fused_decoder as fused_decoder
from actorcore.hf.checkpointing import UNCHECKPOINTED_LAYERS
from actorcore.hf.fused_decoder import FUSED_TRACE_KEY, FusedLayerForward
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL


def _close(eager, fused):
    (lp_e, ent_e, g_e), (lp_f, ent_f, g_f) = eager, fused
    tol = TOL["fused_decoder_vs_eager_fp32"]
    assert (lp_e - lp_f).abs().max().item() < tol and (ent_e - ent_f).abs().max().item() < tol
    assert g_e.keys() == g_f.keys()
    for name in g_e:
        scale = g_e[name].abs().max().item()
        assert (g_e[name] - g_f[name]).abs().max().item() <= TOL["grad_fused_decoder_vs_eager_fp32_rel"] * scale, name


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_fused_layers_on_the_cpu(monkeypatch):
    monkeypatch.setattr(fused_decoder, "fusion_refusal", lambda model: None)
    model = checkpointed(build_tiny_model("llama", seed=3))
    layers = model.config.num_hidden_layers
    batch = _batch()
    handle = ac.patch_model(model)
    eager = _train_step(model, batch, Counter())
    handle.revert()
    model.zero_grad(set_to_none=True)

    handle = ac.patch_model(model, fused_decoder=True)
    forwards = [layer.forward for layer in model.model.layers]
    assert all(isinstance(f, FusedLayerForward) for f in forwards)
    trace = Counter()
    fused = _train_step(model, batch, trace)
    _close(eager, fused)
    assert trace[FUSED_TRACE_KEY] == 2 * layers  # each layer's forward and its recompute in backward
    graphs = _graphs()
    g = torch.Generator().manual_seed(9)
    model.zero_grad(set_to_none=True)
    _train_step(model, ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (5, 40, 12)]), Counter())
    assert _graphs() == graphs, "a pack of another length compiled again"
    calls = sum(f.calls for f in forwards)
    with torch.no_grad():
        model(input_ids=batch.input_ids[None])  # the model's own forward: eager
    assert sum(f.calls for f in forwards) == calls
    twin = copy.deepcopy(model)
    assert all(layer.forward.layer is layer for layer in twin.model.layers)
    handle.revert()
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)

    model.zero_grad(set_to_none=True)
    handle = ac.patch_model(model, fused_decoder=True, checkpointing="selective")
    trace = Counter()
    _close(eager, _train_step(model, batch, trace))
    assert trace[UNCHECKPOINTED_LAYERS] == layers and trace[FUSED_TRACE_KEY] == layers  # no recompute
    handle.revert()
