"""Every family vLLM's CPU build runs, through the real engine in this process: three successive updates through
``VllmBridge``, each after an optimizer step that moves every weight; after each, the log-probs vLLM reports for
freshly sampled tokens (processed log-probs, at temperature 1.0 and 0.7) equal actorcore's on the updated model per
token, and the bridge's own probe agrees. The bridge's report proves what ran: a tied head processed again, every
experts layer repacked again."""

from __future__ import annotations

import pytest
import torch

from actorcore.export import hf_weight_stream
from actorcore.testing.engines import ENGINE_FAMILIES, PROMPTS, engine_model, sample, save_for_engine, start_engine
from actorcore.testing.engines import training_step
from actorcore.testing.tolerances import TOL

UPDATES = 3
MOE = {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"}
# A lm-head module holding the embedding's weight (the second holder processed again); vLLM's Gemma 2 computes its
# logits from the embedding module itself, so there is nothing to process twice there.
TIED = {"qwen2", "gemma3_text"}


def _assert_agrees(model, llm, temperature: float, seed: int) -> None:
    from actorcore.engines import rollout_agreement

    completions, engine_lp = sample(llm, PROMPTS, temperature, seed)
    agreement = rollout_agreement(model, PROMPTS, completions, engine_lp, temperature=temperature)
    for trainer, engine in zip(agreement.log_probs, agreement.engine_log_probs):
        torch.testing.assert_close(trainer, engine, atol=TOL["engine_vs_actorcore_fp32"], rtol=0)
    assert agreement.tokens == sum(len(c) for c in completions) > 0


@pytest.mark.parametrize("model_type", sorted(ENGINE_FAMILIES))
def test_updates_are_exact(model_type, tmp_path, keep_engine):
    from actorcore.engines import VllmBridge

    overrides, _ = ENGINE_FAMILIES[model_type]
    model = engine_model(model_type, overrides)
    llm = keep_engine(start_engine(save_for_engine(model, str(tmp_path / "model"))))
    bridge = VllmBridge(llm)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    _assert_agrees(model, llm, 1.0, seed=0)  # before any update: the engine holds the saved weights
    for step in range(1, UPDATES + 1):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        training_step(model, optimizer, seed=step)
        assert all(not torch.equal(before[n], p) for n, p in model.named_parameters()), "a weight did not move"
        report = bridge.update(hf_weight_stream(model, bucket_bytes=50_000), reference=model)
        assert report.probe.ok and report.probe.max_abs <= TOL["engine_vs_actorcore_fp32"]
        assert report.probe.tokens > bridge.probe_batch.num_tokens - 1  # the prompt and the generated tokens
        assert bool(report.reprocessed_shared) == (model_type in TIED), report.reprocessed_shared
        if model_type in MOE:
            assert report.experts_repacked, "no experts layer was repacked"
        else:
            assert not report.experts_repacked
        assert llm.llm_engine.get_weight_version() == f"actorcore-{step}"
        for temperature in (1.0, 0.7):
            _assert_agrees(model, llm, temperature, seed=10 * step)
    assert bridge.blocked is None and bridge.updates == UPDATES
