"""The pieces of the hybrid (Gated DeltaNet / gated attention) Megatron route, each against an independent
reference: the gated-QKV fuse against transformers' own split of ``q_proj``, the sectioned TP split, the norms
against transformers' modules bitwise, and the config mapping with its refusals."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")


def test_gated_qkv_matches_transformers_split_and_round_trips():
    from actorcore.mcore.convert.transforms import merge_gated_qkv, shard_for_tp, split_gated_qkv

    heads, groups, head_dim, hidden = 4, 2, 3, 5
    gen = torch.Generator().manual_seed(0)
    q_proj = torch.randn(heads * 2 * head_dim, hidden, generator=gen)
    k = torch.randn(groups * head_dim, hidden, generator=gen)
    v = torch.randn(groups * head_dim, hidden, generator=gen)
    fused = merge_gated_qkv(q_proj, k, v, groups)
    # transformers: q_proj(x).view(..., heads, 2 * head_dim).chunk(2) -> query, gate
    query, gate = torch.chunk(q_proj.view(heads, 2 * head_dim, hidden), 2, dim=1)
    per = heads // groups
    grouped = fused.view(groups, (2 * per + 2) * head_dim, hidden)
    for g in range(groups):
        q_rows, gate_rows, k_rows, v_rows = torch.split(grouped[g], [per * head_dim, per * head_dim, head_dim,
                                                                     head_dim])
        assert torch.equal(q_rows, query[g * per:(g + 1) * per].reshape(-1, hidden))
        assert torch.equal(gate_rows, gate[g * per:(g + 1) * per].reshape(-1, hidden))
        assert torch.equal(k_rows, k[g * head_dim:(g + 1) * head_dim])
        assert torch.equal(v_rows, v[g * head_dim:(g + 1) * head_dim])
    assert all(torch.equal(a, b) for a, b in zip(split_gated_qkv(fused, heads, groups), (q_proj, k, v)))
    # TP: each part split first, then fused, is rank r's contiguous block of the full fused tensor
    for rank in range(2):
        local = merge_gated_qkv(*(shard_for_tp(t, "column", rank, 2) for t in (q_proj, k, v)), groups // 2)
        assert torch.equal(local, shard_for_tp(fused, "column", rank, 2))


def test_sectioned_tp_split():
    from actorcore.mcore.convert.transforms import shard_sections, unshard_sections

    full = torch.arange(2 * (4 + 4 + 6)).reshape(-1, 2)  # sections of 4, 4 and 6 rows
    shards = [shard_sections(full, [4, 4, 6], rank, 2) for rank in range(2)]
    assert shards[0][:, 0].tolist() == [0, 2, 8, 10, 16, 18, 20]
    assert shards[1][:, 0].tolist() == [4, 6, 12, 14, 22, 24, 26]
    assert torch.equal(unshard_sections(shards, [4, 4, 6]), full)


def test_sections_only_on_column_renames():
    from actorcore.archs.megatron_rules import WeightRule

    with pytest.raises(ValueError, match="sections"):
        WeightRule("a.weight", ("b.weight",), parallel="row", sections=("linear_key",))
    with pytest.raises(ValueError, match="sections"):
        WeightRule("a.weight", ("b.weight",), parallel="column", sections=("heads",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_equal_transformers_bitwise(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    from actorcore.mcore.build.linear_attention import gated_rms_norm
    from actorcore.mcore.build.norm import ZeroCenteredRMSNorm

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 12, generator=gen).to(dtype)
    gate = torch.randn(7, 12, generator=gen).to(dtype)
    weight = (torch.randn(12, generator=gen) * 0.3).to(dtype)
    theirs, ours = Qwen3_5RMSNorm(12, eps=1e-5).to(dtype), ZeroCenteredRMSNorm(12, eps=1e-5).to(dtype)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        ours.weight.copy_(weight)
    assert torch.equal(ours(x), theirs(x))
    gated = Qwen3_5RMSNormGated(12, eps=1e-5).to(dtype)
    with torch.no_grad():
        gated.weight.copy_(weight)
    assert torch.equal(gated_rms_norm(x, gate, weight, 1e-5), gated(x, gate))


def test_hybrid_config_mapping():
    from actorcore.mcore.build.config import gpt_model_args, hf_to_mcore_config
    from actorcore.testing.tiny_configs import tiny_config

    hf = tiny_config("qwen3_5_text")
    tc = hf_to_mcore_config(hf)
    assert tc.linear_attention_freq == [1, 0]
    assert (tc.linear_num_key_heads, tc.linear_num_value_heads, tc.linear_key_head_dim, tc.linear_value_head_dim,
            tc.linear_conv_kernel_dim) == (2, 6, 8, 12, 3)
    assert tc.attention_output_gate and tc.qk_layernorm and tc.layernorm_zero_centered_gamma
    assert gpt_model_args(hf)["rotary_percent"] == 0.5
    # The released configs' M-RoPE sections (text positions only): plain RoPE
    released = tiny_config("qwen3_5_text", rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                                partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                                                                mrope_interleaved=True))
    assert gpt_model_args(released)["position_embedding_type"] == "rope"


def test_hybrid_config_refusals():
    from actorcore.errors import UnsupportedConfigError
    from actorcore.mcore.build.config import hf_to_mcore_config
    from actorcore.mcore.parallel import McoreParallel
    from actorcore.testing.tiny_configs import tiny_config

    with pytest.raises(UnsupportedConfigError, match="context parallelism"):
        hf_to_mcore_config(tiny_config("qwen3_5_text"), McoreParallel(cp=2))
    with pytest.raises(UnsupportedConfigError, match="sliding_attention"):
        hf_to_mcore_config(tiny_config("qwen3_next", layer_types=["linear_attention", "sliding_attention"]))
    # Partial rotary only where the arch declares it (llama's RoPE rotates the whole head)
    with pytest.raises(UnsupportedConfigError, match="partial_rotary_factor"):
        hf_to_mcore_config(tiny_config("llama", rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                     partial_rotary_factor=0.5)))
