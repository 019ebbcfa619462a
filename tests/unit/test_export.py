"""Weight export, one process: the stream's names, buckets and dtypes, the receivers, the safetensors transport.
The FSDP2 side is tests/dist/test_export_fsdp.py."""

import json
import os

import pytest
import torch

from actorcore.export import (hf_weight_stream, iter_tensors, load_into, load_into_sglang, load_into_vllm,
                              save_sharded_safetensors)
from actorcore.testing.tiny_configs import build_tiny_model

MODEL_TYPES = ["llama", "qwen3_moe", "gemma2"]


def _checkpoint_state(model):
    """What save_pretrained writes: transformers' own tied-duplicate removal and weight-conversion revert."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    return revert_weight_conversion(model, remove_tied_weights_from_state_dict(dict(model.state_dict()), model))


def _nbytes(bucket):
    return sum(t.numel() * t.element_size() for _, t in bucket)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_checkpoint_names_match_save_pretrained_bitwise(model_type):
    model = build_tiny_model(model_type)
    got = dict(iter_tensors(hf_weight_stream(model, bucket_bytes=20_000)))
    want = _checkpoint_state(model)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    if model_type == "gemma2":
        assert "lm_head.weight" not in got  # tied: the checkpoint holds only the embedding
    if model_type == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in got


@pytest.mark.parametrize("bucket_bytes", [1, 5_000, 40_000, 10**9])
def test_buckets_respect_the_bound(bucket_bytes):
    model = build_tiny_model("qwen3_moe")
    buckets = list(hf_weight_stream(model, bucket_bytes=bucket_bytes, names="model"))
    for bucket in buckets:
        assert _nbytes(bucket) <= bucket_bytes or len(bucket) == 1, [n for n, _ in bucket]
    if bucket_bytes == 10**9:
        assert len(buckets) == 1
    names = [n for b in buckets for n, _ in b]
    assert names == [n for n in model.state_dict()]  # state_dict order, nothing lost or repeated
    # Checkpoint names: an oversized bucket is the per-expert views of one fused tensor larger than the bound.
    fused = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
    for bucket in hf_weight_stream(model, bucket_bytes=bucket_bytes):
        if _nbytes(bucket) > bucket_bytes and len(bucket) > 1:
            prefix = bucket[0][0].split(".experts.")[0]
            assert all(n.startswith(prefix + ".experts.") for n, _ in bucket), [n for n, _ in bucket]
            assert _nbytes(bucket) in fused.values()


def test_dtype_is_kept_or_cast_explicitly():
    model = build_tiny_model("llama")
    assert {t.dtype for _, t in iter_tensors(hf_weight_stream(model))} == {torch.float32}
    cast = dict(iter_tensors(hf_weight_stream(model, dtype=torch.bfloat16)))
    assert {t.dtype for t in cast.values()} == {torch.bfloat16}
    for name, tensor in model.state_dict().items():
        assert torch.equal(cast[name], tensor.to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="floating"):
        next(hf_weight_stream(model, dtype=torch.int32))
    with pytest.raises(ValueError, match="names must be"):
        next(hf_weight_stream(model, names="vllm"))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_load_into_a_plain_model_bitwise(model_type):
    source = build_tiny_model(model_type, seed=1)
    target = build_tiny_model(model_type, seed=2)
    load_into(target, hf_weight_stream(source, bucket_bytes=30_000, names="model"))
    want = source.state_dict()
    for name, tensor in target.state_dict().items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
    if model_type == "gemma2":
        assert target.lm_head.weight is target.model.embed_tokens.weight  # still tied


def test_load_into_refuses_unknown_missing_shape_dtype():
    source = build_tiny_model("llama")
    target = build_tiny_model("llama", seed=3)
    pairs = list(iter_tensors(hf_weight_stream(source, names="model")))
    with pytest.raises(ValueError, match="model.layers.9.bogus.weight.*does not have"):
        load_into(target, [pairs + [("model.layers.9.bogus.weight", torch.zeros(2))]])
    with pytest.raises(ValueError, match=r"without 1 of the model's tensors: \['lm_head.weight'\]"):
        load_into(target, [[p for p in pairs if p[0] != "lm_head.weight"]])
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        load_into(target, [[(n, t[:3] if n == "model.norm.weight" else t) for n, t in pairs]])
    with pytest.raises(ValueError, match="model.norm.weight.*torch.bfloat16.*cast explicitly"):
        load_into(target, [[(n, t.bfloat16() if n == "model.norm.weight" else t) for n, t in pairs]])
    with pytest.raises(ValueError, match="twice"):
        load_into(target, [pairs, pairs[:1]])
    moe = build_tiny_model("qwen3_moe")  # checkpoint names of converted weights are not the model's names
    with pytest.raises(ValueError, match="experts.0.gate_proj.weight.*names='model'"):
        load_into(build_tiny_model("qwen3_moe", seed=4), hf_weight_stream(moe))


class _RecordingVllmModel:
    """Stand-in with vLLM's model interface: load_weights(Iterable[(name, tensor)]) -> set of names loaded."""

    def __init__(self):
        self.calls = []

    def load_weights(self, weights):
        seen = [(n, tuple(t.shape), t.dtype, t.numel() * t.element_size()) for n, t in weights]
        self.calls.append(seen)
        return {n for n, *_ in seen}


class _RecordingSglangEngine:
    """Stand-in with SGLang Engine's update_weights_from_tensor(named_tensors, load_format, flush_cache) and
    flush_cache()."""

    def __init__(self):
        self.calls = []
        self.flushes = 0

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(([(n, tuple(t.shape), t.dtype, t.numel() * t.element_size()) for n, t in named_tensors],
                           load_format, flush_cache))

    def flush_cache(self):
        self.flushes += 1


def test_vllm_and_sglang_adapters_get_every_tensor_once_per_bucket():
    model = build_tiny_model("qwen3_moe")
    want = [(n, tuple(t.shape), t.dtype, t.numel() * t.element_size()) for n, t in _checkpoint_state(model).items()]
    buckets = list(hf_weight_stream(model, bucket_bytes=20_000, dtype=torch.bfloat16))
    vllm = _RecordingVllmModel()
    loaded = load_into_vllm(vllm, buckets)
    assert len(vllm.calls) == len(buckets) > 1
    got = [r for call in vllm.calls for r in call]
    assert sorted(got) == sorted((n, s, torch.bfloat16, b // 2) for n, s, _, b in want)
    assert loaded == {n for n, *_ in want}
    sglang = _RecordingSglangEngine()
    assert load_into_sglang(sglang, buckets) == len(buckets)
    assert [r for call, _, _ in sglang.calls for r in call] == got
    assert all(flush is False for _, _, flush in sglang.calls) and sglang.flushes == 1
    with pytest.raises(ValueError, match="load_weights"):
        load_into_vllm(object(), buckets)
    with pytest.raises(ValueError, match="update_weights_from_tensor"):
        load_into_sglang(object(), buckets)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gemma2"])
def test_safetensors_round_trip_through_from_pretrained(tmp_path, model_type):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = build_tiny_model(model_type)
    out = tmp_path / "export"
    weight_map = save_sharded_safetensors(hf_weight_stream(model, bucket_bytes=30_000), str(out),
                                          max_shard_bytes=60_000, config=model.config)
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map and set(weight_map.values()) == set(shards)
    sizes = {}
    for shard in shards:
        with safe_open(str(out / shard), "pt") as f:
            sizes[shard] = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    assert sum(sizes.values()) == index["metadata"]["total_size"]
    assert all(s <= 60_000 for s in sizes.values())
    assert not [f for f in os.listdir(tmp_path) if f != "export"]  # no temporary left behind
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    want = model.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_safetensors_write_is_atomic(tmp_path):
    model = build_tiny_model("llama")

    def failing_stream():
        for k, bucket in enumerate(hf_weight_stream(model, bucket_bytes=20_000)):
            if k == 3:
                raise RuntimeError("sender died")
            yield bucket

    out = tmp_path / "export"
    with pytest.raises(RuntimeError, match="sender died"):
        save_sharded_safetensors(failing_stream(), str(out), max_shard_bytes=20_000)
    assert os.listdir(tmp_path) == []  # neither the output nor the temporary directory
    save_sharded_safetensors(hf_weight_stream(model), str(out))
    with pytest.raises(ValueError, match="exists"):
        save_sharded_safetensors(hf_weight_stream(model), str(out))


def test_bound_counts_the_cast_bytes_and_bad_arguments_are_refused():
    model = build_tiny_model("llama")
    bound = 3 * 64 * 64 * 2  # three bf16 64x64 matrices, 1.5 fp32 ones
    buckets = list(hf_weight_stream(model, bucket_bytes=bound, dtype=torch.bfloat16))
    assert all(_nbytes(b) <= bound or len(b) == 1 for b in buckets)
    assert max(len(b) for b in buckets) >= 3  # the cast size, not the fp32 size, was planned
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        next(hf_weight_stream(model, bucket_bytes=0))


def test_shared_tensors_the_model_does_not_declare_tied_are_refused():
    model = build_tiny_model("llama")
    model.model.norm.weight = model.model.layers[0].input_layernorm.weight  # shared, but no _tied_weights_keys says so
    with pytest.raises(ValueError, match=r"model.layers.0.input_layernorm.weight.*model.norm.weight.*untie"):
        next(hf_weight_stream(model))
