"""``ac.verify`` and ``actorcore verify``: actorcore per token against the model's own forward.

The bf16 / fp16 entries of ``VERIFY_TOLERANCE`` were measured with ``bench/verify_tolerances.py``.
"""

import pytest
import torch

import actorcore as ac
from actorcore.cli import main
from actorcore.hf.verify import VERIFY_TOLERANCE, VerificationError
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tiny_vlm import build_tiny_vlm, mixed_samples
from actorcore.testing.tolerances import TOL

LENGTHS = (7, 13, 31)


def _batch(vocab: int, lengths=LENGTHS, seed: int = 0) -> ac.PackedBatch:
    g = torch.Generator().manual_seed(seed)
    return ac.pack([torch.randint(0, vocab, (n,), generator=g) for n in lengths])


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "qwen3_moe", "deepseek_v3"])
def test_verify_passes_on_registered_architectures(model_type):
    model = build_tiny_model(model_type, seed=1)
    report = ac.verify(model, _batch(131))
    assert report.ok, report.summary()
    assert report.model_type == model_type and report.dtype == "float32"
    assert report.tolerance == VERIFY_TOLERANCE[torch.float32] == 1e-5
    assert report.tokens == sum(n - 1 for n in LENGTHS) and report.sequences == len(LENGTHS)
    assert report.max_abs_diff_logprob <= report.tolerance and report.max_abs_diff_entropy <= report.tolerance
    assert report.raise_if_failed() is report


def test_verify_applies_the_temperature_on_both_sides():
    model = build_tiny_model("gemma2", seed=2)  # final logit softcap, then the temperature
    assert ac.verify(model, _batch(131), temperature=0.6).ok
    # the reference really divides by the temperature: scored at 1.0 by us, 0.6 by the reference, they differ
    from actorcore.hf.reference import reference_logprobs_per_sequence

    batch = _batch(131)
    ref_lp, _ = reference_logprobs_per_sequence(model, batch, temperature=0.6)
    with torch.no_grad():
        ours = ac.compute_logprobs(model, batch, temperature=1.0).log_probs
    assert (ours[1:LENGTHS[0]] - ref_lp[0][1:]).abs().max() > TOL["logprob_changed_by_transform"]


def _halve_logits(model, only_length: int | None = None, position: int | None = None):
    """Wrap the instance's forward: logits / 2 (everywhere, or at one position of sequences of one length)."""
    forward = model.forward

    def wrapped(*args, **kwargs):
        out = forward(*args, **kwargs)
        if only_length is None:
            out.logits = out.logits / 2
        elif out.logits.shape[1] == only_length:
            out.logits = out.logits.clone()
            out.logits[:, position] = out.logits[:, position] / 2
        return out

    model.forward = wrapped


def test_verify_fails_on_a_head_transform_the_route_does_not_know():
    model = build_tiny_model("llama", seed=0)
    _halve_logits(model)
    report = ac.verify(model, _batch(131))
    assert not report.ok
    assert report.max_abs_diff_logprob > 1000 * report.tolerance
    with pytest.raises(VerificationError, match=r"FAIL: llama .*\(sequence, position\).*head transform"):
        report.raise_if_failed()
    with pytest.raises(ValueError):  # VerificationError is a ValueError
        ac.verify(model, _batch(131), strict=True)


def test_verify_names_the_worst_token():
    model = build_tiny_model("llama", seed=0)
    _halve_logits(model, only_length=13, position=4)  # sequence 1 predicts its token 5 from halved logits
    report = ac.verify(model, _batch(131))
    assert not report.ok
    assert report.worst_logprob_token == (1, 5) and report.worst_entropy_token == (1, 5)


def test_verify_bf16_model_uses_the_bf16_bound():
    model = build_tiny_model("qwen3", seed=0, dtype=torch.bfloat16)
    report = ac.verify(model, _batch(131, lengths=(9, 64)))
    assert report.ok, report.summary()
    assert report.dtype == "bfloat16" and report.tolerance == VERIFY_TOLERANCE[torch.bfloat16]
    assert report.max_abs_diff_logprob > VERIFY_TOLERANCE[torch.float32]  # really the 16-bit forward


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "glm4v"])
def test_verify_vlm_batch_splits_pixels_per_sequence(model_type):
    model = build_tiny_vlm(model_type, seed=0)
    samples = mixed_samples(model, seed=3)  # images in sequences 0 and 2 (two there), a video in sequence 3
    batch = ac.pack([s.input_ids for s in samples], multimodal=[s.multimodal for s in samples], model=model)
    report = ac.verify(model, batch)
    assert report.ok, report.summary()
    assert report.sequences == len(samples)


def test_verify_refuses_what_is_not_a_packed_batch():
    with pytest.raises(ValueError, match="PackedBatch"):
        ac.verify(build_tiny_model("llama"), torch.zeros(2, 5, dtype=torch.long))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama", seed=3).save_pretrained(path)
    return path


def test_cli_verify_ok_on_a_saved_model(llama_dir, capsys):
    assert main(["verify", str(llama_dir), "--device", "cpu", "--seq-lens", "5,17", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "tokens compared   20 in 2 sequences" in out and out.strip().endswith("OK")


def test_cli_verify_fail_exit_1(llama_dir, capsys):
    assert main(["verify", str(llama_dir), "--device", "cpu", "--tolerance", "0"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_cli_verify_bf16(llama_dir, capsys):
    assert main(["verify", str(llama_dir), "--device", "cpu", "--dtype", "bfloat16"]) == 0
    assert "llama, bfloat16, cpu" in capsys.readouterr().out


def test_cli_verify_bad_input_is_one_line_exit_2(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    assert main(["verify", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {missing}: no such model directory"
    assert main(["verify", str(tmp_path)]) == 2  # a directory without a config
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["verify", str(tmp_path), "--seq-lens", "1,x"]) == 2


def test_cli_verify_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["verify", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "MODEL_DIR" in out and "--seq-lens" in out and "--dtype" in out


def test_cli_verify_vlm_directory_on_a_text_batch(tmp_path, capsys):
    from actorcore.hf.embedded import build_vlm

    build_vlm(seed=0).save_pretrained(tmp_path)
    assert main(["verify", str(tmp_path), "--device", "cpu", "--seq-lens", "9,40"]) == 0
    assert "qwen2_5_vl, float32" in capsys.readouterr().out


def test_cli_verify_unregistered_architecture_is_exit_2(tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    from actorcore.testing.tiny_configs import COMMON

    config = AutoConfig.for_model("cohere", **COMMON, logit_scale=0.25)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    capsys.readouterr()
    assert main(["verify", str(tmp_path), "--device", "cpu"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "cohere" in errors[0] and "archs/cohere.py" in errors[0]
