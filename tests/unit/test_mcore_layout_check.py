"""``build_gpt_model`` refuses, by the sizes alone (no torch.distributed world, no Megatron parallel state), a
layout megatron-core would assert on deep inside every rank (``mcore.build.layout_check.check_layout``): tp over each
width it splits, pp and vp over the layers, ep over the experts; and ``McoreParallel`` takes positive ints only.
The CLI's refusals of the same are in test_mcore_convert_safety.py."""

from __future__ import annotations

import pytest

from actorcore.testing.tiny_configs import tiny_config

pytest.importorskip("megatron.core")


@pytest.mark.parametrize("model_type,parallel,fragment", [
    ("llama", dict(pp=3), "pp=3 does not divide the model's 2 layers"),
    ("llama", dict(pp=2, vp=2), "vp=2 does not divide the 1 layers of each of the 2 pipeline stages"),
    ("llama", dict(tp=3), "tp=3 does not divide the model's 4 attention heads: the tp sizes that fit this model: 1"),
    ("qwen2_moe", dict(tp=8), "tp=8 does not divide the model's 4 attention heads"),
    ("qwen3_5_text", dict(tp=4), "tp=4 does not divide the model's 2 key-value heads"),
    ("qwen3_moe", dict(ep=3), "ep=3 does not divide the model's 4 experts: the ep sizes that fit this model: 1, 2, 4"),
])
def test_build_gpt_model_refuses_before_megatron_state(model_type, parallel, fragment):
    """The library route: refused by the sizes alone (no torch.distributed world, no Megatron parallel state)."""
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel

    with pytest.raises(ValueError, match="does not divide") as info:
        build_gpt_model(tiny_config(model_type), McoreParallel(**parallel))
    assert fragment in str(info.value)


def test_the_widths_tp_splits_are_each_checked():
    from actorcore.mcore.build.layout_check import check_layout
    from actorcore.mcore.parallel import McoreParallel

    wide_heads = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=6, head_dim=16)
    with pytest.raises(ValueError, match=r"tp=2 does not divide the model's 45 MLP width"):
        check_layout(tiny_config("llama", intermediate_size=45), McoreParallel(tp=2))
    with pytest.raises(ValueError, match=r"tp=3 does not divide the model's 20 shared-expert width"):
        check_layout(tiny_config("qwen2_moe", shared_expert_intermediate_size=20, **wide_heads), McoreParallel(tp=3))
    with pytest.raises(ValueError, match=r"tp=3 does not divide the model's 2 linear-attention key heads"):
        check_layout(tiny_config("qwen3_5_text", intermediate_size=90, **wide_heads), McoreParallel(tp=3))
    check_layout(tiny_config("qwen3_moe", intermediate_size=45, mlp_only_layers=[]), McoreParallel(tp=2))  # all MoE


@pytest.mark.parametrize("value", [0, "2", 1.0, True])
def test_parallel_sizes_are_positive_ints(value):
    from actorcore.mcore.parallel import McoreParallel

    with pytest.raises(ValueError, match=r"tp must be >= 1 \(an int\), got "):
        McoreParallel(tp=value)
