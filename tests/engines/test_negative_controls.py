"""Each failure class the bridge fixes, reproduced against the real engine without it (the control fails: the engine
is left on old or broken weights with no error), then the same update through ``VllmBridge`` (exact), and the
bridge's verification catching what the plain path left:

- ``load_into_vllm`` (vLLM's ``model.load_weights`` after start): the CPU build has repacked its linears, the load
  fails half-way, and the engine holds some layers new and some old;
- vLLM's own layerwise reload of a tied model: the lm-head keeps a repacked copy of the old embedding;
- vLLM's own reload of a MoE model: the experts' repacking is skipped (an error, or experts in the wrong layout);
- an update without resetting the prefix cache: a cached prompt's KV is the old weights'.
"""

from __future__ import annotations

import pytest
import torch

from actorcore.export import hf_weight_stream, iter_tensors, load_into_vllm
from actorcore.testing.engines import ENGINE_FAMILIES, engine_model, save_for_engine, start_engine, training_step
from actorcore.testing.tolerances import TOL

PROMPT = [(7 * i + 3) % 131 for i in range(150)]  # long enough to fill several KV blocks (a cached prefix)
FAR = 1e-3  # a control is "wrong" when it is this far from the trainer; agreement is TOL's 1e-5


def _prompt_log_probs(llm, prompt=PROMPT) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)[0]
    return torch.tensor([entry[t].logprob for t, entry in zip(prompt[1:], out.prompt_logprobs[1:])])


def _cached_continuation(llm, prompt=PROMPT, seed=5) -> tuple[list[int], torch.Tensor]:
    """Tokens sampled after ``prompt`` (a request that reads the prefix cache) and their log-probs."""
    from actorcore.testing.engines import sample

    completions, log_probs = sample(llm, [prompt], 1.0, seed, max_tokens=6)
    return completions[0], torch.tensor(log_probs[0])


def _trainer_log_probs(model, tokens: list[int]) -> torch.Tensor:
    import actorcore as ac

    with torch.no_grad():
        return ac.compute_logprobs(model, ac.pack([torch.tensor(tokens)]), entropy=False).log_probs[1:]


def _trained(model_type: str, tmp_path, keep_engine, engines: int = 1):
    overrides, _ = ENGINE_FAMILIES[model_type]
    model = engine_model(model_type, overrides)
    directory = save_for_engine(model, str(tmp_path / model_type))
    llms = [keep_engine(start_engine(directory)) for _ in range(engines)]
    for llm in llms:
        _cached_continuation(llm)  # the prompt's KV blocks are now in each engine's prefix cache
    training_step(model, torch.optim.Adam(model.parameters(), lr=2e-2), seed=1)
    return model, llms


def _vllm_reload(llm, model) -> None:
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(iter_tensors(hf_weight_stream(model))),
                                                 "is_checkpoint_format": True})
    llm.reset_prefix_cache()


def _exact_through_bridge(llm, model) -> None:
    from actorcore.engines import VllmBridge

    VllmBridge(llm).update(hf_weight_stream(model), reference=model)
    torch.testing.assert_close(_prompt_log_probs(llm), _trainer_log_probs(model, PROMPT),
                               atol=TOL["engine_vs_actorcore_fp32"], rtol=0)


def test_load_into_vllm_fails_half_way_and_the_bridge_does_not(tmp_path, keep_engine):
    model, (llm,) = _trained("qwen3", tmp_path, keep_engine)
    from actorcore.engines.vllm_worker import engine_model as vllm_model

    worker = llm.llm_engine.model_executor.driver_worker.worker
    with pytest.raises(AttributeError, match="weight_loader"):
        load_into_vllm(vllm_model(worker), hf_weight_stream(model, bucket_bytes=10_000))
    llm.reset_prefix_cache()
    assert (_prompt_log_probs(llm) - _trainer_log_probs(model, PROMPT)).abs().max() > FAR  # left half-updated
    _exact_through_bridge(llm, model)


def test_a_tied_head_stays_old_through_vllms_reload_and_not_through_the_bridge(tmp_path, keep_engine):
    from actorcore.engines import EngineUpdateError, VllmBridge

    model, (llm,) = _trained("qwen2", tmp_path, keep_engine)
    _vllm_reload(llm, model)
    assert (_prompt_log_probs(llm) - _trainer_log_probs(model, PROMPT)).abs().max() > FAR
    with pytest.raises(EngineUpdateError, match="does not compute with the trainer's weights"):
        VllmBridge(llm).verify(model)  # the bridge's probe sees what vLLM's reload left
    _exact_through_bridge(llm, model)


def test_moe_experts_are_wrong_through_vllms_reload_and_not_through_the_bridge(tmp_path, keep_engine):
    model, (plain, bridged) = _trained("qwen3_moe", tmp_path, keep_engine, engines=2)
    try:
        _vllm_reload(plain, model)
        wrong = (_prompt_log_probs(plain) - _trainer_log_probs(model, PROMPT)).abs().max() > FAR
    except RuntimeError as exc:  # the repacked experts' shapes no longer match what the reload processed
        wrong = "size of tensor" in str(exc)
    assert wrong
    _exact_through_bridge(bridged, model)


def test_the_prefix_cache_serves_old_weights_unless_reset(tmp_path, keep_engine):
    from actorcore.engines import vllm_worker

    model, (plain, bridged) = _trained("qwen3", tmp_path, keep_engine, engines=2)
    worker = plain.llm_engine.model_executor.driver_worker.worker
    vllm_worker.apply_update(worker, iter_tensors(hf_weight_stream(model)))  # every layer updated, no cache reset
    tokens, engine_lp = _cached_continuation(plain)
    trainer_lp = _trainer_log_probs(model, PROMPT + tokens)[-len(tokens):]
    assert (engine_lp - trainer_lp).abs().max() > FAR  # the cached prompt's KV is the old weights'
    _exact_through_bridge(bridged, model)
    tokens, engine_lp = _cached_continuation(bridged)
    torch.testing.assert_close(engine_lp, _trainer_log_probs(model, PROMPT + tokens)[-len(tokens):],
                               atol=TOL["engine_vs_actorcore_fp32"], rtol=0)
