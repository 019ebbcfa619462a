"""Families whose vLLM implementation differs from transformers' beyond float32 rounding (DeepSeek-V3's MLA,
Apertus' xIELU: ``ENGINE_DIFFERENT_IMPLEMENTATIONS``): the bridge cannot be checked against actorcore there, so an
engine updated through it is checked against a fresh engine started from the trainer's saved weights, per prompt
token (the same kernels on the same weights). And a family the reload protocol cannot update (gpt-oss:
``ENGINE_NOT_UPDATABLE``): vLLM's own reload leaves its experts old without an error; the bridge refuses loudly."""

from __future__ import annotations

import pytest
import torch

from actorcore.export import hf_weight_stream
from actorcore.testing.engines import (ENGINE_DIFFERENT_IMPLEMENTATIONS, ENGINE_NOT_UPDATABLE, engine_model,
                                      save_for_engine, start_engine)
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
    bridge = VllmBridge(llm, tolerance=(0.05, 0.05))  # the implementations' difference grows with training
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    for step in (1, 2):
        training_step(model, optimizer, seed=step)
        report = bridge.update(hf_weight_stream(model), reference=model)
        assert report.probe.max_abs >= measured / 4  # the difference is the implementations', as measured
    fresh = keep_engine(start_engine(save_for_engine(model, str(tmp_path / "after"))))
    prompt = bridge.probe_batch.input_ids.tolist()
    torch.testing.assert_close(_prompt_log_probs(llm, prompt), _prompt_log_probs(fresh, prompt),
                               atol=TOL["engine_updated_vs_fresh_fp32"], rtol=0)


@pytest.mark.parametrize("model_type", sorted(ENGINE_NOT_UPDATABLE))
def test_an_update_the_protocol_cannot_make_is_refused(model_type, tmp_path, keep_engine):
    from actorcore.engines import EngineUpdateError, VllmBridge

    overrides, _ = ENGINE_NOT_UPDATABLE[model_type]
    model = engine_model(model_type, overrides)
    directory = save_for_engine(model, str(tmp_path / "before"))
    plain, bridged = keep_engine(start_engine(directory)), keep_engine(start_engine(directory))
    prompt = list(range(3, 40))
    before = _prompt_log_probs(plain, prompt)
    training_step(model, torch.optim.Adam(model.parameters(), lr=2e-2), seed=1)
    fresh = keep_engine(start_engine(save_for_engine(model, str(tmp_path / "after"))))
    # negative control: vLLM's own reload "succeeds" and the engine is far from the trainer's weights
    plain.collective_rpc("reload_weights", kwargs={"weights_iterator": list(_tensors(model)),
                                                   "is_checkpoint_format": True})
    plain.reset_prefix_cache()
    stale = (_prompt_log_probs(plain, prompt) - _prompt_log_probs(fresh, prompt)).abs().max()
    assert stale > 1e-2 and not torch.equal(before, _prompt_log_probs(fresh, prompt))
    bridge = VllmBridge(bridged, tolerance=(1.0, 1.0))
    with pytest.raises(EngineUpdateError, match=r"experts\.routed_experts \(w13_bias, w13_weight.*took nothing|"
                                                r"received none of their weights"):
        bridge.update(hf_weight_stream(model), reference=model)
    assert "received none of their weights" in bridge.blocked
    with pytest.raises(RuntimeError, match="refuses to generate"):
        _prompt_log_probs(bridged, prompt)


def _tensors(model):
    from actorcore.export import iter_tensors

    return iter_tensors(hf_weight_stream(model))
