"""``actorcore convert``: HF -> Megatron dist checkpoint (at TP / PP / EP) -> HF is bit-exact; damaged input
gives a one-line error, exit code 2 and no output."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")


def _convert(argv: list[str]) -> int:
    from actorcore.cli.convert import main

    return main(argv)


def _tiny(tmp_path, model_type: str, name: str = "hf", **overrides) -> str:
    from actorcore.testing.tiny_configs import build_tiny_model

    directory = str(tmp_path / name)
    build_tiny_model(model_type, seed=11, **overrides).save_pretrained(directory)
    return directory


def _assert_same_checkpoint(a: str, b: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from support.checkpoints import load_checkpoint_tensors

    ref, got = load_file(os.path.join(a, "model.safetensors")), load_checkpoint_tensors(b)  # b: sharded, indexed
    assert sorted(ref) == sorted(got)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    config_a, config_b = AutoConfig.from_pretrained(a).to_dict(), AutoConfig.from_pretrained(b).to_dict()
    config_a.pop("_name_or_path"), config_b.pop("_name_or_path")
    assert config_a == config_b


@pytest.mark.slow
@pytest.mark.parametrize("model_type,layout,overrides", [
    # Two layouts: the CLI's own path (rank processes, dtype from the tensors, sharded output); every architecture
    # at every layout is round-tripped in tests/dist/test_mcore_roundtrip.py.
    ("qwen2", ["--pp", "2"], {"tie_word_embeddings": True, "dtype": torch.bfloat16}),
    ("deepseek_v3", ["--tp", "2", "--ep", "2"], {}),  # MoE at TP > 1: built with sequence parallelism
])
def test_cli_roundtrip_is_bit_exact(tmp_path, model_type, layout, overrides, capsys):
    src = _tiny(tmp_path, model_type, **overrides)
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    assert _convert(["hf-to-mcore", src, mcore, *layout]) == 0
    assert os.path.exists(os.path.join(mcore, "metadata.json"))
    # loads at TP=PP=EP=1 whatever layout wrote it; small shards, so the index spans several files
    assert _convert(["mcore-to-hf", mcore, back, "--max-shard-size", "60000"]) == 0
    _assert_same_checkpoint(src, back)
    assert not os.path.exists(os.path.join(back, "model.safetensors"))
    assert len([n for n in os.listdir(back) if n.endswith(".safetensors")]) > 1
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temporary directory left


@pytest.mark.slow
def test_cli_kimi_k25_release_names_roundtrip_and_load(tmp_path):
    """Kimi-K2.5 under the release's tensor names (``support/kimi_release``): hf-to-mcore -> mcore-to-hf gives the
    same names and tensors bitwise, and transformers loads the export with every parameter of the model it came from,
    so the log-probs are the model's own. A checkpoint under save_pretrained's names converts too and exports under
    the release's names, the same tensors."""
    from transformers import AutoModelForImageTextToText

    import actorcore as ac
    from support.checkpoints import load_checkpoint_tensors
    from support.kimi_release import release_name, save_release_checkpoint
    from actorcore.testing.reference_vlm import reference_logprobs_vlm
    from actorcore.testing.tiny_vlm import build_tiny_vlm, mixed_samples
    from actorcore.testing.tolerances import TOL

    kimi = build_tiny_vlm("kimi_k25", seed=11, tie_word_embeddings=False)
    src = str(tmp_path / "release")
    save_release_checkpoint(kimi, src)
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    assert _convert(["hf-to-mcore", src, mcore]) == 0
    assert _convert(["mcore-to-hf", mcore, back]) == 0
    _assert_same_checkpoint(src, back)
    loaded, info = AutoModelForImageTextToText.from_pretrained(back, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    want = dict(kimi.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in loaded.named_parameters())
    samples = mixed_samples(kimi, seed=12)
    batch = ac.pack([s.input_ids for s in samples], multimodal=[s.multimodal for s in samples], model=loaded.eval())
    with torch.no_grad():
        got = ac.compute_logprobs(loaded, batch).log_probs
        ref = torch.cat([reference_logprobs_vlm(kimi, [s])[0] for s in samples])
    torch.testing.assert_close(got, ref, atol=TOL["vlm_packed_vs_hf_fp32"], rtol=0)

    saved = str(tmp_path / "save_pretrained")
    kimi.save_pretrained(saved)
    assert _convert(["hf-to-mcore", saved, str(tmp_path / "mcore2")]) == 0
    assert _convert(["mcore-to-hf", str(tmp_path / "mcore2"), str(tmp_path / "back2")]) == 0
    written, exported = load_checkpoint_tensors(saved), load_checkpoint_tensors(str(tmp_path / "back2"))
    assert sorted(exported) == sorted(release_name(n) for n in written)
    assert all(torch.equal(exported[release_name(n)], t) for n, t in written.items())


def _rewrite(directory: str, change) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _expect_error(tmp_path, capsys, argv: list[str], *fragments: str) -> None:
    dst = argv[2]
    assert _convert(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    err = errors[0]
    for fragment in fragments:
        assert fragment in err, err
    assert not os.path.exists(dst)
    assert [p for p in os.listdir(os.path.dirname(dst)) if p.startswith(".")] == []


def test_cli_missing_tensor(tmp_path, capsys):
    src = _tiny(tmp_path, "llama")
    _rewrite(src, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    _expect_error(tmp_path, capsys, ["hf-to-mcore", src, str(tmp_path / "out")],
                  "missing tensor model.layers.1.self_attn.k_proj.weight")


def test_cli_wrong_shape(tmp_path, capsys):
    src = _tiny(tmp_path, "llama")
    _rewrite(src, lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 87)))
    _expect_error(tmp_path, capsys, ["hf-to-mcore", src, str(tmp_path / "out")],
                  "model.layers.0.mlp.down_proj.weight has shape [64, 87], expected [64, 88]")


def test_cli_extra_tensor(tmp_path, capsys):
    src = _tiny(tmp_path, "llama")
    _rewrite(src, lambda t: t.__setitem__("model.layers.0.self_attn.rotary.inv_freq", torch.zeros(8)))
    _expect_error(tmp_path, capsys, ["hf-to-mcore", src, str(tmp_path / "out")],
                  "unexpected tensors", "model.layers.0.self_attn.rotary.inv_freq")


def test_cli_damaged_safetensors(tmp_path, capsys):
    src = _tiny(tmp_path, "llama")
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    _expect_error(tmp_path, capsys, ["hf-to-mcore", src, str(tmp_path / "out")], "model.safetensors")


def test_cli_damaged_mcore_checkpoint(tmp_path, capsys):
    src = _tiny(tmp_path, "llama")
    mcore = str(tmp_path / "mcore")
    assert _convert(["hf-to-mcore", src, mcore]) == 0
    for name in os.listdir(mcore):
        if name.endswith(".distcp"):
            os.remove(os.path.join(mcore, name))
    _expect_error(tmp_path, capsys, ["mcore-to-hf", mcore, str(tmp_path / "back")], "cannot load the Megatron checkpoint")


def test_cli_not_an_mcore_checkpoint(tmp_path, capsys):
    src = _tiny(tmp_path, "llama")
    _expect_error(tmp_path, capsys, ["mcore-to-hf", src, str(tmp_path / "back")], "not an actorcore Megatron checkpoint")


def test_cli_int4_kimi_k25_release(tmp_path, capsys):
    """The Kimi-K2.5 release's INT4 experts (compressed-tensors): one line naming them and what to do, exit 2."""
    from support.kimi_release import save_release_checkpoint, with_int4_experts
    from actorcore.testing.tiny_vlm import build_tiny_vlm

    src = str(tmp_path / "hf")
    save_release_checkpoint(build_tiny_vlm("kimi_k25", seed=11, tie_word_embeddings=False), src)
    with_int4_experts(src, "both")
    _expect_error(tmp_path, capsys, ["hf-to-mcore", src, str(tmp_path / "out")], "stored quantized and packed by "
                  "compressed-tensors", "weight_packed", "dequantize the checkpoint first")


def test_cli_refused_architecture(tmp_path, capsys):
    src = _tiny(tmp_path, "gemma2")
    _expect_error(tmp_path, capsys, ["hf-to-mcore", src, str(tmp_path / "out")],
                  "gemma2 is not supported on the Megatron-Core route", "softcapping")


def test_cli_refuses_existing_output(tmp_path, capsys):
    src = _tiny(tmp_path, "llama")
    assert _convert(["hf-to-mcore", src, src]) == 2
    assert "already exists" in capsys.readouterr().err


def test_cli_bad_shard_size(tmp_path, capsys):
    _expect_error(tmp_path, capsys, ["mcore-to-hf", str(tmp_path), str(tmp_path / "back"), "--max-shard-size", "0"],
                  "--max-shard-size must be a positive int of bytes")
