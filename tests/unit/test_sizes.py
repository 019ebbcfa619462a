"""Every size a user hands in is refused unless finite, positive and of the right type, naming the argument and what
to pass (``actorcore.sizes.positive_size``): the byte budgets of the weight streams, the safetensors writer, the IPC
transport and the converter, and the IPC time-outs. NaN was the hole: ``x <= 0`` is False for NaN, so a NaN bucket
bound streamed the whole model as one bucket. And a config's sizes (``check_config_sizes``): what no model can have
is named by its field, while the config of every registered architecture (the tiny one and transformers' default)
passes."""

from __future__ import annotations

import math
import multiprocessing

import numpy as np
import pytest
import torch

from actorcore.archs import registered_model_types
from actorcore.export import hf_weight_stream, ipc_receive, ipc_send, save_sharded_safetensors
from actorcore.mcore.convert.weight_stream import mcore_weight_stream
from actorcore.sizes import check_config_sizes, positive_size
from actorcore.testing.tiny_configs import TINY_CONFIGS, build_tiny_model, tiny_config
from actorcore.testing.tiny_vlm import TINY_VLM_CONFIGS, tiny_vlm_config

BAD_BYTES = [(float("nan"), "nan"), (math.inf, "inf"), ("1GB", "'1GB' (a str)"), (0, "got 0"), (-1, "got -1"),
             (True, "True (a bool)"), (2.5e9, "2500000000.0"), (None, "None (a NoneType)")]


@pytest.mark.parametrize("value,shown", BAD_BYTES, ids=[repr(v) for v, _ in BAD_BYTES])
def test_a_byte_budget_is_a_positive_int(value, shown):
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int of bytes, got ") as info:
        positive_size("bucket_bytes", value)
    assert shown in str(info.value) and "512 * 1024**2" in str(info.value)


def test_good_sizes_come_back_as_numbers():
    assert positive_size("bucket_bytes", np.int64(4096)) == 4096 and type(positive_size("b", np.int64(1))) is int
    assert positive_size("timeout", 2, unit="seconds", integer=False) == 2.0
    with pytest.raises(ValueError, match=r"timeout must be a positive finite number of seconds, got nan"):
        positive_size("timeout", float("nan"), unit="seconds", integer=False)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model("llama", seed=0)


@pytest.mark.parametrize("value", [float("nan"), "1GB", 1e9])
def test_hf_weight_stream_refuses_a_bucket_bound_that_is_not_a_positive_int(model, value):
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int of bytes"):
        next(hf_weight_stream(model, bucket_bytes=value))


@pytest.mark.parametrize("value", [float("nan"), "1GB"])
def test_mcore_weight_stream_refuses_it_at_the_call(value):
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int of bytes"):
        mcore_weight_stream(None, bucket_bytes=value)


@pytest.mark.parametrize("write", [True, False])
@pytest.mark.parametrize("value", [float("nan"), "1GB", -5])
def test_save_sharded_safetensors_names_max_shard_bytes(model, tmp_path, value, write):
    """Before a file is written, and on the ranks that only gather (``write=False``) too."""
    with pytest.raises(ValueError, match=r"max_shard_bytes must be a positive int of bytes, got .*5 \* 1024\*\*3"):
        save_sharded_safetensors(hf_weight_stream(model), str(tmp_path / "out"), value, write=write)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(buffer_bytes=float("nan")), "buffer_bytes must be a positive int of bytes"),
    (dict(buffer_bytes="1GB"), "buffer_bytes must be a positive int of bytes"),
    (dict(timeout=float("nan")), "timeout must be a positive finite number of seconds"),
    (dict(timeout=-1.0), "timeout must be a positive finite number of seconds"),
])
def test_ipc_send_refuses_bad_sizes_before_saying_hello(kwargs, fragment):
    sent = []
    with pytest.raises(ValueError, match=fragment):
        ipc_send([[("a", torch.ones(4))]], _ClosedChannel(sent), **kwargs)
    assert sent == []


class _ClosedChannel:
    """A channel whose other side has gone (so a call that got past its checks ends at once, not waiting for
    ever: a NaN time-out never passes its deadline); it records what was sent."""

    def __init__(self, sent: list) -> None:
        self.sent = sent

    def send(self, data: str) -> None:
        self.sent.append(data)

    def recv(self) -> str:
        raise EOFError


@pytest.mark.parametrize("value", [float("nan"), "30"])
def test_ipc_receive_refuses_a_bad_timeout(value):
    here, _ = multiprocessing.Pipe()
    with pytest.raises(ValueError, match="timeout must be a positive finite number of seconds"):
        ipc_receive(here, timeout=value)


# ---- the sizes of a config ------------------------------------------------------------------------------


def _llama(**fields) -> dict:
    return {**tiny_config("llama").to_dict(), **fields}


def _moe(model_type: str, **fields) -> dict:
    return {**tiny_config(model_type).to_dict(), **fields}


BAD_CONFIGS = [
    (_llama(num_attention_heads=0), "num_attention_heads must be a positive int, got 0"),
    (_llama(num_hidden_layers=-1), "num_hidden_layers must be a positive int, got -1"),
    (_llama(hidden_size="64"), "hidden_size must be a positive int, got '64' (a str)"),
    (_llama(num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (_moe("qwen3_moe", num_experts_per_tok=5), "num_experts_per_tok=5 is more than the model's 4 experts"),
    (_moe("deepseek_v3", num_experts_per_tok=5), "num_experts_per_tok=5 is more than the model's 4 experts"),
    (_moe("deepseek_v3", n_group=3), "n_group=3 does not divide the model's 4 experts"),
    (_moe("glm4_moe", topk_group=3), "topk_group=3 is more than n_group=2"),
    (_moe("glm4_moe", num_experts_per_tok=3), "num_experts_per_tok=3 is more than the 2 experts of the topk_group=1"),
    ({"text_config": _llama(vocab_size=0)}, "config.json's text_config: vocab_size must be a positive int"),
]


@pytest.mark.parametrize("config,fragment", BAD_CONFIGS, ids=[f[:40] for _, f in BAD_CONFIGS])
def test_a_config_no_model_can_have_is_named_by_its_field(config, fragment):
    with pytest.raises(ValueError, match="config.json") as info:
        check_config_sizes(config)
    assert fragment in str(info.value)


def test_a_config_object_is_checked_by_its_language_model():
    config = tiny_config("llama")
    config.num_hidden_layers = -1
    with pytest.raises(ValueError, match="the llama config: num_hidden_layers must be a positive int, got -1"):
        check_config_sizes(config)


@pytest.mark.parametrize("model_type", [t for t in registered_model_types() if t != "kimi_vl"])  # refused: no config
def test_every_registered_architecture_passes(model_type):
    """Its tiny test config (object and saved dict) and transformers' default config (the released shape)."""
    from transformers import AutoConfig

    configs = [AutoConfig.for_model(model_type)]
    if model_type in TINY_CONFIGS or model_type in TINY_VLM_CONFIGS:
        configs.append(tiny_config(model_type) if model_type in TINY_CONFIGS else tiny_vlm_config(model_type))
    for config in configs:
        check_config_sizes(config)
        check_config_sizes(config.to_dict())
