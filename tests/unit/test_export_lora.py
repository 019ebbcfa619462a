"""LoRA (PEFT) export: merged weights equal per element to PEFT's own merge_and_unload (on a deep copy) under the
base model's names, the model untouched; adapters only under PEFT's saved names, loaded back by PEFT itself.
FSDP2: tests/dist/test_export_fp8_lora_fsdp.py."""

import copy

import pytest
import torch

from actorcore.export import hf_weight_stream, iter_tensors, load_into
from actorcore.testing.tiny_configs import build_tiny_model


def _lora_model(model_type="llama", targets=("q_proj", "v_proj", "up_proj", "down_proj"), dtype=torch.float32,
                **lora_kwargs):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=list(targets), lora_dropout=0.0, **lora_kwargs)
    model = peft.get_peft_model(build_tiny_model(model_type, seed=2, dtype=dtype), config)
    _randomize_adapters(model)
    return model


def _randomize_adapters(model, seed=0):
    with torch.no_grad():  # lora_B starts at zero, which would make the merge a copy
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + len(name))) * 0.3)


def _checkpoint_state(model):
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    return revert_weight_conversion(model, remove_tied_weights_from_state_dict(dict(model.state_dict()), model))


def _snapshot(model):
    return {n: t.clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("model_type, targets", [("llama", ("q_proj", "v_proj", "up_proj", "down_proj", "lm_head")),
                                                 ("qwen3_moe", ("q_proj", "v_proj", "o_proj")),
                                                 ("gemma2", ("k_proj", "gate_proj"))])
def test_merged_stream_is_peft_merge_and_unload_bitwise(model_type, targets):
    model = _lora_model(model_type, targets)
    before = _snapshot(model)
    got_model = dict(iter_tensors(hf_weight_stream(model, names="model", bucket_bytes=20_000)))
    got_checkpoint = dict(iter_tensors(hf_weight_stream(model, bucket_bytes=20_000)))
    merged = copy.deepcopy(model).merge_and_unload()
    want = merged.state_dict()
    expected = [n for n in want if not (model_type == "gemma2" and n == "lm_head.weight")]  # tied duplicate
    assert sorted(got_model) == sorted(expected)
    for name in expected:
        assert got_model[name].dtype == want[name].dtype and torch.equal(got_model[name], want[name]), name
    want_checkpoint = _checkpoint_state(merged)
    assert sorted(got_checkpoint) == sorted(want_checkpoint)
    for name, tensor in want_checkpoint.items():
        assert torch.equal(got_checkpoint[name], tensor), name
    changed = [n for n in expected if not torch.equal(want[n], build_tiny_model(model_type, seed=2).state_dict()[n])]
    per_layer = [t for t in targets if t != "lm_head"]
    assert len(changed) == len(per_layer) * model.config.num_hidden_layers + ("lm_head" in targets)
    after = model.state_dict()  # the model itself is not modified
    assert sorted(after) == sorted(before) and all(torch.equal(after[n], t) for n, t in before.items())
    target = build_tiny_model(model_type, seed=9)
    load_into(target, hf_weight_stream(model, names="model"))
    assert all(torch.equal(target.state_dict()[n], want[n]) for n in want)


def test_merged_stream_with_two_active_adapters_and_an_already_merged_one():
    model = _lora_model()
    model.add_adapter("second", copy.deepcopy(model.peft_config["default"]))
    _randomize_adapters(model, seed=100)
    model.base_model.set_adapter(["default", "second"])
    got = dict(iter_tensors(hf_weight_stream(model, names="model")))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    model.base_model.set_adapter("default")
    model.merge_adapter()  # the base weights now hold the adapter: it must not be added twice
    got = dict(iter_tensors(hf_weight_stream(model, names="model")))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_merged_bf16_is_computed_in_fp32_and_rounded_once():
    model = _lora_model(dtype=torch.bfloat16)
    got = dict(iter_tensors(hf_weight_stream(model, names="model")))
    base = model.get_base_model()
    for layer_index, layer in enumerate(base.model.layers):
        proj = layer.self_attn.q_proj
        w, a, b = proj.base_layer.weight, proj.lora_A["default"].weight, proj.lora_B["default"].weight
        want = (w.float() + (b.float() @ a.float()) * proj.scaling["default"]).to(torch.bfloat16)  # plain torch
        name = f"model.layers.{layer_index}.self_attn.q_proj.weight"
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want), name


def test_adapters_only_under_peft_names_load_back_in_peft(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import save_file

    model = _lora_model("qwen3_moe", ("q_proj", "v_proj", "o_proj"))
    got = dict(iter_tensors(hf_weight_stream(model, lora="adapters", bucket_bytes=1_000)))
    want = peft.get_peft_model_state_dict(model)
    assert list(got) == list(want) and all("lora_" in n for n in got)
    assert all(got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want)
    # a PEFT loader accepts them: adapter_config.json + adapter_model.safetensors, as PEFT's save_pretrained writes
    model.peft_config["default"].save_pretrained(str(tmp_path))
    save_file({n: t.contiguous() for n, t in got.items()}, str(tmp_path / "adapter_model.safetensors"))
    reloaded = peft.PeftModel.from_pretrained(build_tiny_model("qwen3_moe", seed=2), str(tmp_path))
    reloaded_state = reloaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded_state[name], tensor), name
    bf16 = dict(iter_tensors(hf_weight_stream(model, lora="adapters", dtype=torch.bfloat16)))
    assert all(torch.equal(bf16[n], want[n].bfloat16()) for n in want)


def test_lora_refusals():
    plain = build_tiny_model("llama")
    with pytest.raises(ValueError, match="lora='adapters' needs a PEFT model"):
        next(hf_weight_stream(plain, lora="adapters"))
    with pytest.raises(ValueError, match="lora must be one of"):
        next(hf_weight_stream(plain, lora="unmerged"))
    model = _lora_model()
    with pytest.raises(ValueError, match="not to LoRA adapters"):
        next(hf_weight_stream(model, lora="adapters", quantize="fp8_blockwise"))
    with pytest.raises(ValueError, match="DoRA"):
        next(hf_weight_stream(_lora_model(use_dora=True)))
    with pytest.raises(ValueError, match="Embedding"):
        next(hf_weight_stream(_lora_model(targets=("q_proj", "embed_tokens"))))
    with pytest.raises(ValueError, match="modules_to_save"):
        next(hf_weight_stream(_lora_model(modules_to_save=["lm_head"])))


def test_merged_lora_in_fp8():
    from actorcore.export import quantize_fp8_blockwise

    model = _lora_model()
    got = dict(iter_tensors(hf_weight_stream(model, quantize="fp8_blockwise")))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        q, s = quantize_fp8_blockwise(merged[name])
        assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(got[name + "_scale_inv"], s)
    assert got["model.norm.weight"].dtype == torch.float32 and "lm_head.weight_scale_inv" not in got
