"""Errors that used to name the wrong cause (or none) now name the real one, and what worked by accident keeps
working: ``verify`` on a model with a NaN weight names the weight (not the arch spec); ``verify`` / ``demo`` /
``convert`` on a Megatron checkpoint directory say what it is and how to convert it (not "Unrecognized model");
an MXFP4 checkpoint without its ``quantization_config`` or with a half pair names that (not "dtype U8"); a model
patched with the MoE experts path pickles and deep-copies, and cast afterwards to a dtype the path cannot run is
refused before the forward (not 30 frames inside grouped_mm)."""

from __future__ import annotations

import copy
import io
import json
import os
from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.cli import main
from actorcore.errors import CheckpointError, NonFiniteError
from actorcore.testing.tiny_configs import build_tiny_model


def _batch() -> ac.PackedBatch:
    g = torch.Generator().manual_seed(0)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (7, 12, 5)])


def _with_nan(model_type: str = "llama"):
    model = build_tiny_model(model_type, seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    return model


def test_verify_on_a_nan_weight_names_the_weight():
    with pytest.raises(NonFiniteError, match=r"llama's own forward gives NaN or inf .*its weights hold NaN or inf "
                                             r"\(model.layers.1.mlp.down_proj.weight\)"):
        ac.verify(_with_nan(), _batch())


def test_cli_verify_on_a_nan_weight_is_one_line_not_the_spec(tmp_path, capsys):
    _with_nan().save_pretrained(tmp_path / "nan")
    code, err = main(["verify", str(tmp_path / "nan"), "--device", "cpu"]), capsys.readouterr().err
    assert code == 2 and "model.layers.1.mlp.down_proj.weight" in err and "spec" not in err, err


def _megatron_checkpoint_dir(root) -> str:
    """What ``actorcore convert hf-to-mcore`` writes, as far as a loader looking for an HF model sees it."""
    directory = root / "mcore"
    (directory / "hf").mkdir(parents=True)
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                         "sharded_backend_version": 1}))
    (directory / "__0_0.distcp").write_bytes(b"\0" * 16)
    (directory / ".metadata").write_bytes(b"\0" * 16)
    (directory / "actorcore.json").write_text("{}")
    build_tiny_model("llama").config.save_pretrained(directory / "hf")
    return str(directory)


@pytest.mark.parametrize("argv", [["verify", "DIR", "--device", "cpu"], ["demo", "--model", "DIR", "--sp", "0",
                                                                          "--device", "cpu"]])
def test_a_megatron_checkpoint_is_named_as_one(tmp_path, capsys, argv):
    directory = _megatron_checkpoint_dir(tmp_path)
    code, err = main([directory if a == "DIR" else a for a in argv]), capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is a Megatron distributed checkpoint, not a Hugging Face model directory" in err
    assert f"actorcore convert mcore-to-hf {directory} HF_DIR" in err and "Unrecognized" not in err


# ---- MXFP4 checkpoints -----------------------------------------------------------------------------------

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _mxfp4_dir(root, name: str, *, drop: str | None = None, quantization_config: bool = True) -> str:
    """The tiny gpt-oss as its release stores it (experts as MXFP4 blocks + scales), minus what the test takes."""
    from safetensors.torch import save_file

    from actorcore.kernels.mxfp4 import quantize_mxfp4

    model = build_tiny_model("gpt_oss", seed=1, intermediate_size=96)
    state = {}
    for key, tensor in model.state_dict().items():
        if key.endswith(EXPERTS):
            state[key + "_blocks"], state[key + "_scales"] = quantize_mxfp4(tensor.transpose(-1, -2).contiguous())
        else:
            state[key] = tensor.to(torch.bfloat16).contiguous()
    if drop is not None:
        del state[drop]
    directory = os.path.join(root, name)
    os.makedirs(directory)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization_config:
        config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(path, "w") as f:
        json.dump(config, f)
    return directory


def test_an_mxfp4_checkpoint_reads_its_experts_dequantised(tmp_path):
    from actorcore.mcore.convert.safetensors_reader import SafetensorsReader, safetensors_dtype

    reader = SafetensorsReader(_mxfp4_dir(tmp_path, "ok"))
    name = "model.layers.0.mlp.experts.down_proj"
    assert name in reader.names() and not any(n.endswith(("_blocks", "_scales")) for n in reader.names())
    assert reader.dtype(name) == torch.bfloat16 and safetensors_dtype(reader.directory) == torch.bfloat16


def test_an_mxfp4_checkpoint_missing_blocks_is_named_incomplete(tmp_path):
    from actorcore.mcore.convert.safetensors_reader import SafetensorsReader

    directory = _mxfp4_dir(tmp_path, "half", drop="model.layers.1.mlp.experts.gate_up_proj_blocks")
    with pytest.raises(CheckpointError, match=r"the MXFP4 weight model.layers.1.mlp.experts.gate_up_proj has "
                                              r"model.layers.1.mlp.experts.gate_up_proj_scales but no "
                                              r"model.layers.1.mlp.experts.gate_up_proj_blocks: the checkpoint is "
                                              "incomplete"):
        SafetensorsReader(directory)


def test_an_mxfp4_checkpoint_without_its_quantization_config_is_named(tmp_path):
    from actorcore.mcore.convert.safetensors_reader import SafetensorsReader

    directory = _mxfp4_dir(tmp_path, "undeclared", quantization_config=False)
    with pytest.raises(CheckpointError, match=r"4 weights are stored as MXFP4 blocks and scales .* its config.json "
                                              r"declares no quantization_config: restore the release's "
                                              "quantization_config"):
        SafetensorsReader(directory)


# ---- a model patched with the MoE experts path -----------------------------------------------------------


@pytest.fixture
def patched_moe():
    model = build_tiny_model("qwen3_moe", seed=0)
    handle = ac.patch_model(model, moe_experts="sorted")
    yield model, _runs_the_path(model, handle.state.targets("moe_experts")), handle.state.targets("moe_experts")
    handle.revert()


def _runs_the_path(model, names) -> torch.Tensor:
    """The model's experts modules each hold one config copy naming actorcore's function, whose own config is the
    model's; an actorcore call runs the path in every one of them: its log-probs."""
    from actorcore.hf.features.moe_experts import OWN_CONFIG_ATTR

    configs = {id(model.model.get_submodule(name).config) for name in names}
    installed = model.model.get_submodule(names[0]).config
    assert configs == {id(installed)} and installed._experts_implementation == "actorcore_sorted"
    assert getattr(installed, OWN_CONFIG_ATTR) is model.config
    trace = Counter()
    log_probs = ac.compute_logprobs(model, _batch(), trace=trace).log_probs
    assert trace["moe_experts:modules"] == len(names)
    return log_probs


def test_torch_save_of_a_patched_moe_model_loads_and_runs_the_path(patched_moe):
    """Bitwise the same log-probs per token, the path counted in every experts module of the loaded model."""
    model, want, names = patched_moe
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(_runs_the_path(loaded, names), want)


def test_deepcopy_of_a_patched_moe_model_runs_with_its_own_weights(patched_moe):
    model, want, names = patched_moe
    copied = copy.deepcopy(model)
    assert torch.equal(_runs_the_path(copied, names), want)
    with torch.no_grad():
        copied.model.get_submodule(names[0]).down_proj.mul_(2.0)
    assert not torch.equal(_runs_the_path(copied, names), want)
    assert torch.equal(_runs_the_path(model, names), want)


def test_a_patched_moe_model_cast_to_float64_is_refused_before_the_forward(patched_moe):
    model, _, _ = patched_moe
    model.double()
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts's weights are torch.float64; grouped_mm runs float32, bf16 "
                                         r"and fp16: the model was cast after patch_model"):
        ac.compute_logprobs(model, _batch())
