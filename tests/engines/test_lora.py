"""A LoRA-trained policy (PEFT) into the engine: the stream merges the active adapters into the base weights
(``hf_weight_stream``'s default ``lora="merged"``), and after each of three steps that train only the adapters the
engine's sampled-token log-probs equal actorcore's on the PEFT model, per token."""

from __future__ import annotations

import pytest
import torch

from actorcore.export import hf_weight_stream
from actorcore.testing.engines import ENGINE_FAMILIES, assert_agrees, engine_model, save_for_engine, start_engine
from actorcore.testing.engines import training_step
from actorcore.testing.tolerances import TOL


def test_merged_lora_updates_are_exact(tmp_path, keep_engine):
    peft = pytest.importorskip("peft")
    from actorcore.engines import VllmBridge

    overrides, _ = ENGINE_FAMILIES["qwen3_moe"]
    base = engine_model("qwen3_moe", overrides)
    llm = keep_engine(start_engine(save_for_engine(base, str(tmp_path / "base"))))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                             lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    bridge = VllmBridge(llm)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    atol = TOL["engine_vs_actorcore_fp32"]
    for step in (1, 2, 3):
        before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        training_step(model, optimizer, seed=step)
        moved = [not torch.equal(before[n], p) for n, p in model.named_parameters() if "lora_" in n]
        assert all(moved) if step > 1 else any(moved)  # B starts at 0: A's first gradient is 0
        report = bridge.update(hf_weight_stream(model), reference=model)
        assert report.probe.ok and report.probe.max_abs <= atol
        for temperature in (1.0, 0.7):
            assert_agrees(model, llm, temperature, 10 * step, atol)
    merged = model.merge_and_unload()  # what the engine now holds, as plain weights
    assert_agrees(merged, llm, 1.0, 99, atol)
