"""Megatron per-token log-probs / entropy / values == the model's own transformers forward per token (fp32),
at TP=2, PP=2 and EP=2 (gloo, CPU). The reference is plain transformers (``ForCausalLM.forward`` /
``ForTokenClassification.forward`` on the padded batch), never actorcore's HF route.

Every case of one world size runs in one spawn (a module-scoped fixture per world size); each test asserts its
own case's results."""

from __future__ import annotations

import os

import pytest
import torch

from support.mcore_cases import spawn_cases
from actorcore.testing.tolerances import TOL
from support.mcore_logprobs import logprob_batches, logprobs_case, check_logprobs, logprob_sequences, tiny_hf, reference_logprobs_packed


pytest.importorskip("megatron.core")

def _reference_values(critic, sequences: list[torch.Tensor]) -> torch.Tensor:
    """``[T]`` values in packed order: ``ForTokenClassification.forward``'s 1-label logits at each token."""
    from actorcore.testing.reference import padded_logits, padded_to_packed, right_padded

    ids, mask = right_padded(sequences)
    return padded_to_packed(padded_logits(critic, ids, mask)[..., 0].float(), mask)


# (model_type, tp, pp, ep, HF config overrides) of the log-prob cases, by test name.
_LOGPROB_CASES = {
    "dense_tp2": ("qwen2", 2, 1, 1, {}),
    "dense_pp2": ("llama", 1, 2, 1, {"tie_word_embeddings": True}),  # tied: the last stage's head is the embedding
    "moe_ep2": ("qwen3_moe", 1, 1, 2, {}),
    # DeepSeek-V3: MLA, sigmoid grouped routing with a (random) score-correction bias, shared experts.
    "mla_moe_ep2": ("deepseek_v3", 1, 1, 2, {}),
    # DeepSeek's yarn RoPE (with mscale on the softmax scale) maps exactly.
    "mla_yarn_rope": ("deepseek_v3", 1, 1, 1, {
        "max_position_embeddings": 512,
        "rope_parameters": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
                                beta_slow=1.0, mscale=0.9, mscale_all_dim=0.8, rope_theta=10000.0)}),
    # gpt-oss: sinks, a sliding then a full layer (one per stage), yarn RoPE, clamped SwiGLU experts with biases.
    "gpt_oss_pp2": ("gpt_oss", 1, 2, 1, {}),
    "gpt_oss_ep2": ("gpt_oss", 1, 1, 2, {}),
}


def _logprob_cases(root: str, world_size: int) -> list[tuple]:
    cases = []
    for name, (model_type, tp, pp, ep, overrides) in _LOGPROB_CASES.items():
        if tp * pp * ep == world_size:
            directory = os.path.join(root, name)
            tiny_hf(model_type, **overrides).save_pretrained(directory)
            cases.append((name, logprobs_case, (model_type, tp, pp, ep, directory, overrides)))
    return cases


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """Every one-rank case of this file, in one spawn."""
    return spawn_cases(1, _logprob_cases(str(tmp_path_factory.mktemp("mcore_logprobs1")), 1))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Every two-rank case of this file, in one spawn."""
    from actorcore.testing.tiny_configs import build_tiny_model

    root = str(tmp_path_factory.mktemp("mcore_logprobs2"))
    cases = _logprob_cases(root, 2)
    build_tiny_model("qwen3", seed=5, num_hidden_layers=4).save_pretrained(os.path.join(root, "vp"))
    build_tiny_model("qwen2", seed=9, task="token_classification").save_pretrained(os.path.join(root, "critic"))
    tiny_hf("deepseek_v3").save_pretrained(os.path.join(root, "moe_tp2"))
    cases += [("vp", _vp_case, (os.path.join(root, "vp"),)),
              ("critic", _critic_case, (os.path.join(root, "critic"),)),
              ("moe_tp2", _moe_tp2_case, (os.path.join(root, "moe_tp2"),))]
    results = spawn_cases(2, cases)
    results["vp_reference"] = _load_reference(os.path.join(root, "vp"))
    return results


def _load_reference(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.mark.slow
def test_logprobs_dense_tp2(world2):
    check_logprobs(world2["dense_tp2"])


@pytest.mark.slow
def test_logprobs_dense_pp2(world2):
    """Tied embeddings: the last stage's output weight is loaded from the embedding."""
    check_logprobs(world2["dense_pp2"])


@pytest.mark.slow
def test_logprobs_moe_ep2(world2):
    check_logprobs(world2["moe_ep2"])


@pytest.mark.slow
def test_logprobs_mla_moe_ep2(world2):
    """DeepSeek-V3: MLA, sigmoid grouped routing with a (random) score-correction bias, shared experts."""
    check_logprobs(world2["mla_moe_ep2"])


@pytest.mark.slow
def test_logprobs_mla_yarn_rope(world1):
    """DeepSeek's yarn RoPE (with mscale on the softmax scale) maps exactly."""
    check_logprobs(world1["mla_yarn_rope"])


@pytest.mark.slow
def test_logprobs_gpt_oss_pp2(world2):
    """gpt-oss: attention sinks, the sliding layer on stage 0 and the full one on stage 1, yarn RoPE, clamped SwiGLU
    experts with biases (the expert-bias path at EP=1); TP=2 trains in test_mcore_moe_tp.py."""
    check_logprobs(world2["gpt_oss_pp2"])


@pytest.mark.slow
def test_logprobs_gpt_oss_ep2(world2):
    check_logprobs(world2["gpt_oss_ep2"])


def _vp_case(directory: str) -> dict:
    """4 layers on 2 pipeline ranks x 2 virtual stages (interleaved schedule)."""
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict
    from actorcore.testing.tiny_configs import build_tiny_model

    hf = build_tiny_model("qwen3", seed=5, num_hidden_layers=4)
    parallel = McoreParallel(pp=2, vp=2)
    initialize_megatron(parallel)
    model = build_gpt_model(hf.config, parallel)
    assert len(model.chunks) == 2
    load_hf_into_mcore(model, directory)
    layers = [[layer.layer_number for layer in chunk.decoder.layers] for chunk in model.chunks]
    batches = logprob_batches(pad_to=32)[:2]  # the interleaved schedule needs micro-batches divisible by pp
    got = compute_logprobs(model, batches)
    with torch.no_grad():
        ref = [reference_logprobs_packed(hf, sequences) for sequences in logprob_sequences()[:2]]
    return {"got": [(o.log_probs, o.entropy) for o in got], "ref": ref, "layers": layers,
            "state": gather_hf_state_dict(model)}


@pytest.mark.slow
def test_virtual_pipeline_stages(world2):
    results, reference = world2["vp"], world2["vp_reference"]
    assert [r["layers"] for r in results] == [[[1], [3]], [[2], [4]]]  # Megatron's interleaved layer order
    tol = TOL["mcore_vs_hf_fp32"]
    for result in results:
        for (lp, ent), (ref_lp, ref_ent) in zip(result["got"], result["ref"]):
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0)
        assert sorted(result["state"]) == sorted(reference)
        for name, tensor in reference.items():
            assert torch.equal(result["state"][name], tensor), name


def _critic_case(directory: str) -> dict:
    from actorcore.mcore.run.forward import compute_values
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.testing.tiny_configs import build_tiny_model

    hf = build_tiny_model("qwen2", seed=9, task="token_classification")
    parallel = McoreParallel(tp=2)
    initialize_megatron(parallel)
    # With sequence parallelism: the value head all-gathers the final hidden states first.
    model = build_gpt_model(hf.config, parallel, value_head=True, sequence_parallel=True)
    load_hf_into_mcore(model, directory)
    got = compute_values(model, logprob_batches())
    with torch.no_grad():
        ref = [_reference_values(hf, sequences) for sequences in logprob_sequences()]
    return {"got": got, "ref": ref}


@pytest.mark.slow
def test_critic_values_tp2(world2):
    for result in world2["critic"]:
        for got, ref in zip(result["got"], result["ref"]):
            assert got.dtype == torch.float32 and got.shape == ref.shape
            torch.testing.assert_close(got, ref, atol=TOL["mcore_vs_hf_fp32"], rtol=0)


def _moe_tp2_case(directory: str) -> dict:
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    hf = tiny_hf("deepseek_v3")
    parallel = McoreParallel(tp=2)
    initialize_megatron(parallel)
    model = build_gpt_model(hf.config, parallel, sequence_parallel=False)
    load_hf_into_mcore(model, directory)
    batches = logprob_batches()
    got = compute_logprobs(model, batches)
    with torch.no_grad():
        ref = [reference_logprobs_packed(hf, sequences) for sequences in logprob_sequences()]
    try:
        compute_logprobs(model, batches, loss_fn=lambda out, batch: out.log_probs.sum())
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"got": [(o.log_probs, o.entropy) for o in got], "ref": ref, "refused": refused,
            "sequence_parallel": model.config.sequence_parallel}


@pytest.mark.slow
def test_logprobs_moe_tp2_forward_only(world2):
    """MoE (here MLA + routed/shared experts) at TP=2 built without sequence parallelism: forward-only log-probs
    == transformers; training refused clearly (test_mcore_moe_tp.py trains it with sequence parallelism)."""
    for result in world2["moe_tp2"]:
        for (lp, ent), (ref_lp, ref_ent) in zip(result["got"], result["ref"]):
            torch.testing.assert_close(lp, ref_lp, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
        assert not result["sequence_parallel"]
        assert "needs sequence parallelism" in result["refused"]
