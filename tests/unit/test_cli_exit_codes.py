"""The documented exit codes of every sub-command (0 OK, 1 FAIL, 2 bad input), with bad input always one line on
stderr and never a traceback: damaged and escaping checkpoints, missing directories (never the hub), devices that
are not there, bad flags. Run in-process through ``actorcore.cli.main`` to stay cheap."""

import json
import os
import struct

import pytest
import torch

from actorcore.cli import main
from actorcore.testing.tiny_configs import build_tiny_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A sharded and a single-file tiny model, and damaged / escaping copies of them."""
    root = tmp_path_factory.mktemp("cli")
    model = build_tiny_model("llama", seed=3)
    sharded, single = root / "sharded", root / "single"
    model.save_pretrained(sharded, max_shard_size="100KB")
    model.save_pretrained(single)
    made = {"sharded": sharded, "single": single, "missing": root / "missing"}

    def copy(src, name):
        dst = root / name
        dst.mkdir()
        for f in os.listdir(src):
            (dst / f).write_bytes((src / f).read_bytes())
        return dst

    shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    d = made["truncated_shard"] = copy(sharded, "truncated_shard")
    (d / shards[-1]).write_bytes((d / shards[-1]).read_bytes()[:-100])
    d = made["truncated_file"] = copy(single, "truncated_file")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000])
    d = made["impossible_tensor"] = copy(single, "impossible_tensor")
    data = (d / "model.safetensors").read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    first = next(k for k in header if k != "__metadata__")
    header[first]["shape"] = [10**6, 10**6]  # declares far more bytes than its offsets span
    text = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size:])
    outside = root / "outside"
    outside.mkdir()
    for kind in ("dotdot", "absolute"):
        d = made[kind] = copy(sharded, kind)
        index = json.loads((d / "model.safetensors.index.json").read_text())
        name = shards[0]
        (outside / name).write_bytes((d / name).read_bytes())
        os.remove(d / name)
        target = f"../outside/{name}" if kind == "dotdot" else str(outside / name)
        index["weight_map"] = {k: (target if v == name else v) for k, v in index["weight_map"].items()}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    d = made["symlink"] = copy(single, "symlink")
    (outside / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    os.remove(d / "model.safetensors")
    os.symlink(outside / "model.safetensors", d / "model.safetensors")
    return made


def _run(capsys, argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's refusals (one line, exit 2: cli/errors.py)
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_bad_input(code, err, *needles):
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0] == err.strip().splitlines()[-1], err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


VERIFY_BAD = [("missing", [], "no such model directory"), ("truncated_shard", [], "not a readable safetensors"),
              ("truncated_file", [], "not a readable safetensors"),
              ("impossible_tensor", [], "not a readable safetensors"), ("dotdot", [], "climbs out"),
              ("absolute", [], "not a plain name"), ("symlink", [], "outside the model directory"),
              ("single", ["--seq-lens", "1,x"], "--seq-lens"), ("single", ["--dtype", "int8"], "invalid choice"),
              ("single", ["--temperature", "0"], "--temperature")]


@pytest.mark.parametrize("which, extra, needle", VERIFY_BAD, ids=[f"{w}{'-' + e[0] if e else ''}"
                                                                   for w, e, _ in VERIFY_BAD])
def test_verify_bad_input_is_one_line_and_exit_2(capsys, dirs, which, extra, needle):
    code, _, err = _run(capsys, ["verify", dirs[which], "--device", "cpu", *extra])
    _assert_bad_input(code, err, needle)


def test_verify_ok_is_0_and_fail_is_1(capsys, dirs, monkeypatch):
    from transformers import LlamaForCausalLM

    code, out, _ = _run(capsys, ["verify", dirs["sharded"], "--device", "cpu"])
    assert code == 0 and out.strip().endswith("OK")
    forward = LlamaForCausalLM.forward

    def scaled(self, *args, **kwargs):  # a head transform the spec does not know of: a real difference
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 1.5
        return out

    monkeypatch.setattr(LlamaForCausalLM, "forward", scaled)
    code, out, err = _run(capsys, ["verify", dirs["single"], "--device", "cpu"])
    assert code == 1 and "FAIL" in out and "Traceback" not in err


DEMO_BAD = [(["--model", "missing"], "no such model directory"),
            (["--model", "truncated_shard"], "not a readable safetensors"),
            (["--model", "dotdot"], "climbs out"), (["--sp", "-1"], "--sp"), (["--device", "tpu"], "invalid choice")]


@pytest.mark.parametrize("args, needle", DEMO_BAD, ids=[" ".join(a) for a, _ in DEMO_BAD])
def test_demo_bad_input_is_one_line_and_exit_2(capsys, dirs, args, needle):
    argv = ["demo", *[dirs.get(a, a) if i and args[i - 1] == "--model" else a for i, a in enumerate(args)]]
    if "--device" not in args:
        argv += ["--device", "cpu"]
    code, _, err = _run(capsys, argv)
    _assert_bad_input(code, err, needle)
    assert "huggingface.co" not in err


@pytest.mark.parametrize("sp", ["3", "8"])
def test_demo_sp_the_heads_cannot_take_is_refused_before_any_rank(capsys, monkeypatch, sp):
    import actorcore.parallel.spawn as spawn

    def refuse(*args, **kwargs):
        raise AssertionError("the error must be found before any rank is spawned")

    monkeypatch.setattr(spawn, "run_distributed", refuse)
    code, _, err = _run(capsys, ["demo", "--sp", sp, "--device", "cpu"])
    _assert_bad_input(code, err, f"--sp {sp}: the embedded model's 4 attention heads (2 key-value heads) cannot be "
                                 "split over", "use --sp 2 or 4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_demo_on_cuda_without_cuda_is_exit_2(capsys):
    code, _, err = _run(capsys, ["demo", "--device", "cuda", "--sp", "0"])
    _assert_bad_input(code, err, "no CUDA device")


def test_demo_on_a_save_pretrained_directory_without_tokenizer_files(capsys, dirs, caplog):
    assert not any(f.startswith(("tokenizer", "vocab")) for f in os.listdir(dirs["single"]))
    with caplog.at_level("WARNING"):
        code, out, _ = _run(capsys, ["demo", "--model", dirs["single"], "--sp", "0", "--device", "cpu"])
    assert code == 0 and "OK: packed path agrees" in out
    assert any("no tokenizer files" in r.getMessage() for r in caplog.records)


CONVERT_BAD = [(["hf-to-mcore", "missing", "OUT"], "no such directory"),
               (["hf-to-mcore", "dotdot", "OUT"], "climbs out"),
               (["hf-to-mcore", "absolute", "OUT"], "not a plain name"),
               (["hf-to-mcore", "symlink", "OUT"], "outside the model directory"),
               (["hf-to-mcore", "truncated_file", "OUT"], "not a readable safetensors"),
               (["hf-to-mcore", "single", "OUT", "--tp", "0"], "--tp"),
               (["mcore-to-hf", "single", "OUT"], "not an actorcore Megatron checkpoint"),
               (["hf-to-mcore", "single"], "required"), (["sideways", "a", "b"], "invalid choice")]


@pytest.mark.parametrize("args, needle", CONVERT_BAD, ids=[" ".join(a) for a, _ in CONVERT_BAD])
def test_convert_bad_input_is_one_line_and_exit_2(capsys, dirs, tmp_path, args, needle):
    pytest.importorskip("megatron.core")
    argv = ["convert", *[str(tmp_path / "out") if a == "OUT" else dirs.get(a, a) for a in args]]
    code, _, err = _run(capsys, argv)
    _assert_bad_input(code, err, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["--model"], ["verify"], ["no-such-command"], ["verify", "x", "--bogus"]])
def test_argument_errors_are_one_line_and_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error:"), err
