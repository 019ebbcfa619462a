"""The engine bridge's parts that need no engine: the vLLM version range, the probe's comparison (tolerance, the
stale check, the first token), the agreement statistics against plain torch, and ``rollout_agreement`` against the
model's own forward (``log_softmax`` of its logits, one sequence at a time) standing in for an engine. The bridge
itself is proven against the real engine in ``tests/engines``."""

import math

import pytest
import torch

from actorcore.engines.agreement import agreement_stats, rollout_agreement
from actorcore.engines.probe import DEFAULT_TOLERANCE, compare_probe
from actorcore.engines.vllm_worker import TESTED_VLLM, check_vllm_version
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.3"])
def test_tested_vllm_releases_pass(version):
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_other_vllm_releases_are_refused_with_the_range(version):
    with pytest.raises(ValueError, match=rf"vLLM {version} is outside .*{TESTED_VLLM}"):
        check_vllm_version(version)


def test_an_unreadable_version_is_refused():
    with pytest.raises(ValueError, match="cannot read the vLLM version"):
        check_vllm_version("main-dev")


def _engine(prompt_lp, generated_ids=(), generated_lp=()):
    return {"prompt_ids": list(range(len(prompt_lp))), "prompt": torch.tensor(prompt_lp),
            "generated_ids": list(generated_ids), "generated": torch.tensor(generated_lp, dtype=torch.float32)}


def test_the_probe_compares_every_scored_token_and_skips_the_first():
    trainer = torch.tensor([0.0, -1.0, -2.0, -0.5, -3.0])

    def reference(batch):
        assert batch.input_ids.tolist() == [0, 1, 2, 9, 8]  # the prompt, then the generated tokens
        return trainer

    engine = _engine([123.0, -1.0, -2.0], generated_ids=[9, 8], generated_lp=[-0.5, -3.00002])
    result = compare_probe(engine, reference, torch.float32, None)
    assert result.ok and result.tokens == 4 and result.prompt_scored == 2
    assert result.max_abs == pytest.approx(2e-5, rel=1e-2)  # token 0's 123.0 is not compared
    engine["generated"][1] = -3.001
    result = compare_probe(engine, reference, torch.float32, None)
    assert not result.ok and "at probe token 4" in result.reason and f"{DEFAULT_TOLERANCE[torch.float32][0]:g}" \
        in result.reason


def test_an_engine_that_did_not_move_while_the_trainer_did_is_stale_at_any_tolerance():
    loose = (10.0, 10.0)
    first = compare_probe(_engine([0.0, -1.0, -2.0]), lambda b: torch.tensor([0.0, -1.0, -2.0]), torch.bfloat16,
                          loose)
    same_engine = compare_probe(_engine([0.0, -1.0, -2.0]), lambda b: torch.tensor([0.0, -1.1, -2.0]),
                                torch.bfloat16, loose, previous=first)
    assert not same_engine.ok and "still computes with the old weights" in same_engine.reason
    both_still = compare_probe(_engine([0.0, -1.0, -2.0]), lambda b: torch.tensor([0.0, -1.0, -2.0]),
                               torch.bfloat16, loose, previous=first)
    assert both_still.ok  # nothing trained: nothing to move


def test_non_finite_engine_log_probs_fail():
    result = compare_probe(_engine([0.0, float("nan"), -2.0]), lambda b: torch.tensor([0.0, -1.0, -2.0]),
                           torch.float32, (10.0, 10.0))
    assert not result.ok and "not finite" in result.reason


def test_agreement_statistics_match_plain_torch():
    trainer = torch.tensor([-1.0, -2.0, -0.1, -5.0])
    engine = torch.tensor([-1.0, -2.5, -0.1, -3.0])
    max_abs, mean_abs, k3, beyond, weights = agreement_stats(trainer, engine, threshold=0.4, clip=2.0)
    r = [0.0, 0.5, 0.0, -2.0]  # trainer - engine
    assert max_abs == pytest.approx(2.0) and mean_abs == pytest.approx(2.5 / 4)
    assert k3 == pytest.approx(sum(math.exp(x) - 1 - x for x in r) / 4)
    assert beyond == pytest.approx(0.5)
    assert weights.tolist() == pytest.approx([1.0, min(math.exp(0.5), 2.0), 1.0, math.exp(-2.0)])


def _plain_token_log_probs(model, ids, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double() / temperature
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].float()


def test_rollout_agreement_against_the_models_own_forward():
    model = build_tiny_model("qwen3")
    prompts, completions = [[3, 5, 9], [7, 3]], [[11, 2, 40, 8], [90]]
    temperature = 0.7
    engine = [_plain_token_log_probs(model, p + c, temperature)[-len(c):].tolist() for p, c in zip(prompts, completions)]
    agreement = rollout_agreement(model, prompts, completions, engine, temperature=temperature)
    assert [t.numel() for t in agreement.log_probs] == [4, 1] and agreement.tokens == 5
    for ours, theirs in zip(agreement.log_probs, engine):
        torch.testing.assert_close(ours, torch.tensor(theirs), atol=TOL["packed_vs_hf_fp32"], rtol=0)
    assert agreement.max_abs <= TOL["packed_vs_hf_fp32"] and agreement.fraction_beyond == 0.0
    for w in agreement.importance_weights:
        torch.testing.assert_close(w, torch.ones_like(w), atol=1e-4, rtol=0)


@pytest.mark.parametrize("bad, message", [
    (dict(engine_log_probs=[[-1.0]]), "equally long"),
    (dict(completions=[[1, 2], [3]], engine_log_probs=[[-1.0], [-1.0]]), "rollout 0: 2 completion tokens but 1"),
    (dict(prompts=[[], [4]]), "rollout 0 has an empty prompt"),
    (dict(clip=0.5), "clip >= 1"),
])
def test_rollout_agreement_refuses_bad_input(bad, message):
    model = build_tiny_model("qwen3")
    args = dict(prompts=[[3, 5], [4]], completions=[[1], [2]], engine_log_probs=[[-1.0], [-1.0]])
    kwargs = {k: v for k, v in bad.items() if k in ("clip", "threshold")}
    args.update({k: v for k, v in bad.items() if k in args})
    with pytest.raises(ValueError, match=message):
        rollout_agreement(model, args["prompts"], args["completions"], args["engine_log_probs"], **kwargs)
