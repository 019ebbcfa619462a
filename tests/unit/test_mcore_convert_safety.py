"""``actorcore convert`` on hostile or unlucky input: a checkpoint cannot run code, weights keep their dtype,
side-file links stay inside the model, a full disk and bad flags are one-line errors (exit 2) caught before any
work, and the output directory follows the umask. In-process, tiny llama (about a second per conversion)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess

import pytest
import torch

pytest.importorskip("megatron.core")


def _convert(argv: list[str]) -> int:
    from actorcore.cli.convert import main

    return main(argv)


def _save_tiny(directory: str, **overrides) -> str:
    from actorcore.testing.tiny_configs import build_tiny_model

    build_tiny_model("llama", seed=11, **overrides).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(HF dir, Megatron checkpoint of it), shared by the tests that only read them."""
    root = tmp_path_factory.mktemp("shared")
    src = _save_tiny(str(root / "hf"))
    assert _convert(["hf-to-mcore", src, str(root / "mcore")]) == 0
    return src, str(root / "mcore")


def _copy_tree(src: str, dst: str) -> str:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _one_error(capsys, *fragments: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def _nothing_left(dst: str) -> None:
    assert not os.path.exists(dst)
    parent = os.path.dirname(dst)
    assert [n for n in os.listdir(parent) if n.startswith(f".{os.path.basename(dst)}.tmp-")] == []


# ---- 1. loading never runs code from the checkpoint ----------------------------------------------------


class _Payload:
    """Unpickling this runs ``touch <marker>``, as a crafted checkpoint file would."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("target", [".metadata", "common.pt"])
def test_crafted_pickle_runs_nothing(tmp_path, checkpoints, capsys, target):
    mcore = _copy_tree(checkpoints[1], str(tmp_path / "mcore"))
    marker = tmp_path / "payload-ran"
    path = os.path.join(mcore, target)
    if target == "common.pt":
        torch.save(_Payload(str(marker)), path)
    else:
        with open(path, "wb") as f:
            pickle.dump(_Payload(str(marker)), f)
    dst = str(tmp_path / "back")
    assert _convert(["mcore-to-hf", mcore, dst]) == 2
    assert not marker.exists()
    _one_error(capsys, target, "refused")
    _nothing_left(dst)


def test_byte_items_are_never_unpickled(tmp_path, checkpoints):
    """torch unpickles a checkpoint's byte items with ``weights_only=False``; they must never be read: the
    conversion succeeds with every byte item overwritten by garbage."""
    from actorcore.mcore.convert.safe_load import read_dcp_metadata

    mcore = _copy_tree(checkpoints[1], str(tmp_path / "mcore"))
    metadata = read_dcp_metadata(os.path.join(mcore, ".metadata"))
    overwritten = 0
    for index, info in metadata.storage_data.items():
        if index.fqn.split("/")[0].endswith("_extra_state"):
            with open(os.path.join(mcore, info.relative_path), "r+b") as f:
                f.seek(info.offset)
                f.write(b"\x80" * info.length)
            overwritten += 1
    assert overwritten
    assert _convert(["mcore-to-hf", mcore, str(tmp_path / "back")]) == 0


# ---- 2. weights keep the dtype of their tensors ------------------------------------------------------


def test_dtype_comes_from_the_tensors_not_the_config(tmp_path):
    from safetensors.torch import load_file

    from support.checkpoints import load_checkpoint_tensors

    src = _save_tiny(str(tmp_path / "hf"))
    config_path = os.path.join(src, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    with open(config_path, "w") as f:
        json.dump(config, f)
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    assert _convert(["hf-to-mcore", src, mcore]) == 0
    assert _convert(["mcore-to-hf", mcore, back]) == 0
    ref, got = load_file(os.path.join(src, "model.safetensors")), load_checkpoint_tensors(back)
    assert sorted(ref) == sorted(got)
    for name, tensor in ref.items():
        assert tensor.dtype == torch.float32 and got[name].dtype == torch.float32, name
        assert torch.equal(got[name], tensor), name


def test_mixed_dtypes_are_refused(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src = _save_tiny(str(tmp_path / "hf"))
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].bfloat16()
    save_file(tensors, path, metadata={"format": "pt"})
    dst = str(tmp_path / "out")
    assert _convert(["hf-to-mcore", src, dst]) == 2
    _one_error(capsys, "several dtypes", "model.norm.weight")
    _nothing_left(dst)



def _release_layout_deepseek_v3(directory: str, **keep: torch.dtype) -> tuple[str, dict]:
    """A tiny deepseek_v3 saved as its release is stored: bf16, the router's correction bias float32 (transformers'
    own save_pretrained writes the router's gate weight in float32 too); ``keep``: more names kept in float32."""
    from safetensors.torch import load_file, save_file

    from actorcore.testing.tiny_configs import build_tiny_model

    build_tiny_model("deepseek_v3", seed=5, dtype=torch.bfloat16).save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32  # as transformers saves
    tensors = {n: t if n.endswith("e_score_correction_bias") or n in keep.values() else t.bfloat16()
               for n, t in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return directory, tensors


def test_float32_expert_bias_in_a_bf16_checkpoint_round_trips_bit_exact(tmp_path):
    from support.checkpoints import load_checkpoint_tensors

    src, ref = _release_layout_deepseek_v3(str(tmp_path / "hf"))
    assert {t.dtype for t in ref.values()} == {torch.bfloat16, torch.float32}
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "back")
    assert _convert(["hf-to-mcore", src, mcore]) == 0
    assert _convert(["mcore-to-hf", mcore, back]) == 0
    got = load_checkpoint_tensors(back)
    assert sorted(ref) == sorted(got)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def test_float32_router_weight_in_a_bf16_checkpoint_is_refused(tmp_path, capsys):
    """Only the expert bias is exempt: Megatron holds the router's weight in the model dtype, so transformers' own
    float32 ``gate.weight`` would be rounded, and is refused."""
    src, _ = _release_layout_deepseek_v3(str(tmp_path / "hf"), gate="model.layers.1.mlp.gate.weight")
    dst = str(tmp_path / "out")
    assert _convert(["hf-to-mcore", src, dst]) == 2
    _one_error(capsys, "several dtypes", "model.layers.1.mlp.gate.weight", "expert bias")
    _nothing_left(dst)

# ---- 3. side files: links must resolve inside the model ----------------------------------------------


def test_link_out_of_the_source_is_refused(tmp_path, capsys):
    src = _save_tiny(str(tmp_path / "hf"))
    secret = tmp_path / "elsewhere" / "secret"
    secret.parent.mkdir()
    secret.write_text("not the model's")
    os.symlink(secret, os.path.join(src, "tokenizer.model"))
    dst = str(tmp_path / "out")
    assert _convert(["hf-to-mcore", src, dst]) == 2
    _one_error(capsys, "tokenizer.model", "outside the model directory")
    _nothing_left(dst)


def test_links_inside_the_source_and_the_hub_cache_are_copied(tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    src = _save_tiny(str(repo / "snapshots" / "0123abcd"))
    (repo / "blobs").mkdir()
    (repo / "blobs" / "f00d").write_text("tokenizer from the cache")
    os.symlink("../../blobs/f00d", os.path.join(src, "tokenizer.model"))  # as huggingface_hub lays it out
    os.makedirs(os.path.join(src, "extra"))
    with open(os.path.join(src, "extra", "template.jinja"), "w") as f:
        f.write("{{ messages }}")
    os.symlink("extra/template.jinja", os.path.join(src, "chat_template.jinja"))
    mcore = str(tmp_path / "mcore")
    assert _convert(["hf-to-mcore", src, mcore]) == 0
    with open(os.path.join(mcore, "hf", "tokenizer.model")) as f:
        assert f.read() == "tokenizer from the cache"
    with open(os.path.join(mcore, "hf", "chat_template.jinja")) as f:
        assert f.read() == "{{ messages }}"
    assert not os.path.islink(os.path.join(mcore, "hf", "tokenizer.model"))


# ---- 5. a full disk is one line ----------------------------------------------------------------------


def test_injected_disk_full_is_one_line(tmp_path, checkpoints, capsys, monkeypatch):
    monkeypatch.setenv("ACTORCORE_TEST_FAIL_AT", "saving:ENOSPC")
    dst = str(tmp_path / "out")
    assert _convert(["hf-to-mcore", checkpoints[0], dst]) == 2
    _one_error(capsys, "no space left")
    _nothing_left(dst)


def test_real_disk_full_is_one_line(tmp_path, checkpoints, capsys):
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        dst = str(disk / "out")
        assert _convert(["hf-to-mcore", checkpoints[0], dst]) == 2
        _one_error(capsys, "no space left")
        _nothing_left(dst)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_rank_disk_full_is_one_line(tmp_path, checkpoints, capsys, monkeypatch):
    """A rank process failing (here: a full disk) stops the other rank and leaves nothing."""
    monkeypatch.setenv("ACTORCORE_TEST_FAIL_AT", "saving:ENOSPC")
    dst = str(tmp_path / "out")
    assert _convert(["hf-to-mcore", checkpoints[0], dst, "--tp", "2"]) == 2
    _one_error(capsys, "no space left")
    _nothing_left(dst)


# ---- 6. the output follows the umask -----------------------------------------------------------------


@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o027, 0o750)])
def test_output_mode_follows_umask(tmp_path, checkpoints, umask, mode):
    previous = os.umask(umask)
    try:
        dst = str(tmp_path / "out")
        assert _convert(["hf-to-mcore", checkpoints[0], dst]) == 0
    finally:
        os.umask(previous)
    assert os.stat(dst).st_mode & 0o777 == mode


def test_stale_temp_of_a_dead_run_is_swept(tmp_path, checkpoints, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".out.tmp-{dead.pid}-0badf00d"
    (stale / "hf").mkdir(parents=True)
    assert _convert(["hf-to-mcore", checkpoints[0], str(tmp_path / "out")]) == 0
    assert not stale.exists()
    assert str(stale) in capsys.readouterr().err


# ---- 7. errors name what was wrong, before any work --------------------------------------------------


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a rank is spawned or weights are loaded."""
    import actorcore.cli.convert as convert

    def refuse(*args, **kwargs):
        raise AssertionError("the error must be found before any rank or weight")

    monkeypatch.setattr(convert, "run_ranks", refuse)
    monkeypatch.setattr(convert, "_hf_to_mcore_rank", refuse)


def _six_heads(directory: str) -> str:
    from actorcore.testing.tiny_configs import tiny_config

    config = tiny_config("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    config.save_pretrained(directory)
    return directory


def _tiny_vlm_config(directory: str) -> str:
    from actorcore.testing.tiny_vlm import tiny_vlm_config

    tiny_vlm_config("qwen2_5_vl").save_pretrained(directory)
    return directory


@pytest.mark.parametrize("flags,fragments", [
    (["--vocab-multiple", "0"], ["--vocab-multiple must be a positive integer, got 0"]),
    (["--tp", "3", "vlm"], ["--tp 3 does not divide the model's 4 attention heads"]),  # its text_config's
    (["--tp", "3"], ["--tp 3 does not divide the model's 4 attention heads"]),
    (["--tp", "0"], ["--tp must be a positive integer"]),
    (["--tp", "4", "six-heads"], ["--tp 4 does not divide the model's 6 attention heads"]),
    (["--mtp"], ["has no multi-token-prediction rules on the Megatron route"]),
])
def test_bad_layout_is_named_before_work(tmp_path, checkpoints, capsys, no_work, flags, fragments):
    src = _six_heads(str(tmp_path / "six")) if "six-heads" in flags else checkpoints[0]
    src = _tiny_vlm_config(str(tmp_path / "vlm")) if "vlm" in flags else src
    flags = [f for f in flags if f not in ("six-heads", "vlm")]
    dst = str(tmp_path / "out")
    assert _convert(["hf-to-mcore", src, dst, *flags]) == 2
    _one_error(capsys, *fragments)
    _nothing_left(dst)


def _edited_config_dir(directory: str, model_type: str, **fields) -> str:
    """A directory holding only config.json: the tiny config of ``model_type`` with ``fields`` written in as they
    would stand in a hand-edited file (transformers itself chokes on some of them while loading)."""
    from actorcore.testing.tiny_configs import tiny_config

    tiny_config(model_type).save_pretrained(directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(fields)
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


MEGATRON_ASSERTS = [
    ("llama", {}, ["--pp", "3"], "--pp 3 does not divide the model's 2 layers into equal pipeline stages: the --pp "
                                 "sizes that fit this model: 1, 2"),
    ("qwen3_moe", {}, ["--ep", "3"], "--ep 3 does not divide the model's 4 experts: the --ep sizes that fit this "
                                     "model: 1, 2, 4"),
    ("llama", {}, ["--ep", "2"], "--ep 2: llama has no experts to split (a dense model): use --ep 1"),
    ("llama", dict(intermediate_size=90, num_key_value_heads=4), ["--tp", "4"],
     "--tp 4 does not divide the model's 90 MLP width (intermediate_size): the --tp sizes that fit this model: 1, 2"),
    ("deepseek_v3", dict(n_group=3), [], "config.json: n_group=3 does not divide the model's 4 experts"),
    ("llama", dict(num_attention_heads=0), [], "config.json: num_attention_heads must be a positive int, got 0"),
    ("qwen3_moe", dict(num_experts_per_tok=5), [], "num_experts_per_tok=5 is more than the model's 4 experts"),
    ("deepseek_v3", dict(num_experts_per_tok=5), [], "num_experts_per_tok=5 is more than the model's 4 experts"),
    ("llama", dict(num_hidden_layers=-1), [], "config.json: num_hidden_layers must be a positive int, got -1"),
]


@pytest.mark.parametrize("model_type,fields,flags,fragment", MEGATRON_ASSERTS,
                         ids=[f"{t}-{'-'.join(f) or next(iter(c))}" for t, c, f, _ in MEGATRON_ASSERTS])
def test_what_megatron_asserts_on_is_named_before_work(tmp_path, capsys, no_work, model_type, fields, flags,
                                                       fragment):
    """Sizes and config fields megatron-core asserts on deep in every rank (an empty AssertionError for --ep 3),
    or that end in ZeroDivisionError / "math domain error": one line, before any rank or weight."""
    src = _edited_config_dir(str(tmp_path / "hf"), model_type, **fields)
    dst = str(tmp_path / "out")
    assert _convert(["hf-to-mcore", src, dst, *flags]) == 2
    _one_error(capsys, fragment)
    _nothing_left(dst)


@pytest.mark.parametrize("direction", ["hf-to-mcore", "mcore-to-hf"])
def test_missing_source_directory(tmp_path, capsys, no_work, direction):
    dst = str(tmp_path / "out")
    assert _convert([direction, str(tmp_path / "nowhere"), dst]) == 2
    _one_error(capsys, "nowhere: no such directory")
    _nothing_left(dst)


def _edit_layers(config_path: str, layers: int) -> None:
    with open(config_path) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(config_path, "w") as f:
        json.dump(config, f)


def test_edited_hf_config_names_the_tensors(tmp_path, capsys):
    src = _save_tiny(str(tmp_path / "hf"))
    _edit_layers(os.path.join(src, "config.json"), 3)
    dst = str(tmp_path / "out")
    assert _convert(["hf-to-mcore", src, dst]) == 2
    _one_error(capsys, "the config and the weights disagree", "missing tensor model.layers.2.self_attn.q_proj.weight")
    _nothing_left(dst)


def test_edited_mcore_config_names_the_tensors(tmp_path, checkpoints, capsys):
    mcore = _copy_tree(checkpoints[1], str(tmp_path / "mcore"))
    _edit_layers(os.path.join(mcore, "hf", "config.json"), 3)
    dst = str(tmp_path / "back")
    assert _convert(["mcore-to-hf", mcore, dst]) == 2
    _one_error(capsys, "config.json and its weights disagree", "decoder.layers.self_attention.linear_qkv."
               "layer_norm_weight has shape [2, 64], the config builds [3, 64]")
    _nothing_left(dst)
