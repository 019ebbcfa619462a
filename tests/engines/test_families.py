"""Every family vLLM's CPU build runs, through the real engine in this process: three successive updates through
``VllmBridge``, each after an optimizer step that moves every weight; after each, the log-probs vLLM reports for
freshly sampled tokens (processed log-probs, at temperature 1.0 and 0.7) equal actorcore's on the updated model per
token, and the bridge's own probe agrees. The bridge's report proves what ran: a tied head processed again, every
experts layer repacked again."""

from __future__ import annotations

import pytest

from actorcore.testing.engines import (ENGINE_FAMILIES, assert_agrees, engine_model, save_for_engine, start_engine,
                                      train_and_update)
from actorcore.testing.tolerances import TOL

UPDATES = 3
MOE = {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"}
# A lm-head module holding the embedding's weight (the second holder processed again); vLLM's Gemma 2 computes its
# logits from the embedding module itself, so there is nothing to process twice there.
TIED = {"qwen2", "gemma3_text"}


@pytest.mark.parametrize("model_type", sorted(ENGINE_FAMILIES))
def test_updates_are_exact(model_type, tmp_path, keep_engine):
    from actorcore.engines import VllmBridge

    overrides, _ = ENGINE_FAMILIES[model_type]
    model = engine_model(model_type, overrides)
    llm = keep_engine(start_engine(save_for_engine(model, str(tmp_path / "model"))))
    bridge = VllmBridge(llm)
    assert_agrees(model, llm, 1.0, 0, TOL["engine_vs_actorcore_fp32"])  # before any update: the saved weights
    reports = train_and_update(model, llm, bridge, UPDATES, TOL["engine_vs_actorcore_fp32"],
                               dict(bucket_bytes=50_000))
    for report in reports:
        assert report.probe.tokens > bridge.probe_batch.num_tokens - 1  # the prompt and the generated tokens
        assert bool(report.reprocessed_shared) == (model_type in TIED), report.reprocessed_shared
        assert bool(report.experts_repacked) == (model_type in MOE), report.experts_repacked
    assert llm.llm_engine.get_weight_version() == f"actorcore-{UPDATES}"
    assert bridge.blocked is None and bridge.updates == UPDATES
