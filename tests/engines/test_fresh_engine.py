"""Families whose vLLM implementation differs from transformers' beyond float32 rounding (gpt-oss, DeepSeek-V3's
MLA, Apertus' xIELU: ``ENGINE_DIFFERENT_IMPLEMENTATIONS``): the bridge cannot be checked against actorcore there,
so an engine updated through it is checked against a fresh engine started from the trainer's saved weights, per
prompt token (the same kernels on the same weights); the bridge's probe runs with the measured disagreement as its
tolerance, and the disagreement itself stays what it was before the update (the engine follows the trainer)."""

from __future__ import annotations

import pytest
import torch

from actorcore.export import hf_weight_stream
from actorcore.testing.engines import ENGINE_DIFFERENT_IMPLEMENTATIONS, engine_model, save_for_engine, start_engine
from actorcore.testing.engines import training_step
from actorcore.testing.tolerances import TOL


def _prompt_log_probs(llm, prompt: list[int]) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)[0]
    return torch.tensor([entry[t].logprob for t, entry in zip(prompt[1:], out.prompt_logprobs[1:])])


@pytest.mark.parametrize("model_type", sorted(ENGINE_DIFFERENT_IMPLEMENTATIONS))
def test_update_equals_a_fresh_engine(model_type, tmp_path, keep_engine):
    from actorcore.engines import VllmBridge

    overrides, measured, _ = ENGINE_DIFFERENT_IMPLEMENTATIONS[model_type]
    model = engine_model(model_type, overrides)
    llm = keep_engine(start_engine(save_for_engine(model, str(tmp_path / "before"))))
    tolerance = (4 * measured, 4 * measured)
    bridge = VllmBridge(llm, tolerance=tolerance)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    for step in (1, 2):
        training_step(model, optimizer, seed=step)
        report = bridge.update(hf_weight_stream(model), reference=model)
        assert report.probe.max_abs <= 4 * measured
    fresh = keep_engine(start_engine(save_for_engine(model, str(tmp_path / "after"))))
    prompt = bridge.probe_batch.input_ids.tolist()
    torch.testing.assert_close(_prompt_log_probs(llm, prompt), _prompt_log_probs(fresh, prompt),
                               atol=TOL["engine_updated_vs_fresh_fp32"], rtol=0)
