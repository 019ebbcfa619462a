"""HF config -> TransformerConfig field table: tiny configs, and the typed-in real configs of Qwen2.5-7B,
Qwen3-8B, Qwen3-30B-A3B and DeepSeek-V3 (config.json values, no downloads), field by field."""

from __future__ import annotations

import dataclasses
import logging
import re

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from transformers import AutoConfig  # noqa: E402

from actorcore.mcore.build.config import (  # noqa: E402
    UnsupportedConfigError,
    gpt_model_args,
    hf_to_mcore_config,
    mcore_fields,
    mcore_to_hf_config,
    uses_interleaved_mrope,
)
from actorcore.archs import UnsupportedArchitectureError, get_spec  # noqa: E402
from actorcore.mcore.build.model import megatron_model_types, refused_megatron_model_types  # noqa: E402
from actorcore.mcore.parallel import McoreParallel  # noqa: E402

QWEN2_5_7B = dict(
    attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643, hidden_act="silu", hidden_size=3584,
    initializer_range=0.02, intermediate_size=18944, max_position_embeddings=131072, max_window_layers=28,
    num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4, rms_norm_eps=1e-06, rope_theta=1000000.0,
    sliding_window=131072, tie_word_embeddings=False, use_cache=True, use_sliding_window=False, vocab_size=152064,
)
QWEN3_8B = dict(
    attention_bias=False, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, head_dim=128,
    hidden_act="silu", hidden_size=4096, initializer_range=0.02, intermediate_size=12288,
    max_position_embeddings=40960, max_window_layers=36, num_attention_heads=32, num_hidden_layers=36,
    num_key_value_heads=8, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000, sliding_window=None,
    tie_word_embeddings=False, use_cache=True, use_sliding_window=False, vocab_size=151936,
)
QWEN3_30B_A3B = dict(
    attention_bias=False, attention_dropout=0.0, bos_token_id=151643, decoder_sparse_step=1, eos_token_id=151645,
    head_dim=128, hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=6144,
    max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[], moe_intermediate_size=768,
    norm_topk_prob=True, num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
    num_key_value_heads=4, output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None,
    rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False,
    use_cache=True, use_sliding_window=False, vocab_size=151936,
)
DEEPSEEK_V3 = dict(
    attention_bias=False, attention_dropout=0.0, aux_loss_alpha=0.001, bos_token_id=0, eos_token_id=1, ep_size=1,
    first_k_dense_replace=3, hidden_act="silu", hidden_size=7168, initializer_range=0.02, intermediate_size=18432,
    kv_lora_rank=512, max_position_embeddings=163840, moe_intermediate_size=2048, moe_layer_freq=1, n_group=8,
    n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128, num_experts_per_tok=8,
    num_hidden_layers=61, num_key_value_heads=128, num_nextn_predict_layers=1, q_lora_rank=1536,
    qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-06,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"),
    rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", seq_aux=True, tie_word_embeddings=False,
    topk_group=4, topk_method="noaux_tc", use_cache=True, v_head_dim=128, vocab_size=129280,
)


def _check(tc, expected: dict) -> None:
    for name, value in expected.items():
        assert getattr(tc, name) == value, f"{name}: {getattr(tc, name)!r} != {value!r}"


def test_qwen2_5_7b():
    hf = AutoConfig.for_model("qwen2", **QWEN2_5_7B)
    tc = hf_to_mcore_config(hf, McoreParallel(tp=2), torch.bfloat16)
    _check(tc, dict(num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4, kv_channels=128,
                    ffn_hidden_size=18944, layernorm_epsilon=1e-6, add_qkv_bias=True, add_bias_linear=False,
                    qk_layernorm=False, gated_linear_unit=True, normalization="RMSNorm", window_size=None,
                    num_moe_experts=None, tensor_model_parallel_size=2, params_dtype=torch.bfloat16, bf16=True,
                    hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02))
    assert tc.activation_func is torch.nn.functional.silu
    assert gpt_model_args(hf) == dict(vocab_size=152064, max_sequence_length=131072,
                                      share_embeddings_and_output_weights=False, position_embedding_type="rope",
                                      rotary_base=1000000.0)


def test_qwen3_8b():
    hf = AutoConfig.for_model("qwen3", **QWEN3_8B)
    tc = hf_to_mcore_config(hf)
    _check(tc, dict(num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8, kv_channels=128,
                    ffn_hidden_size=12288, qk_layernorm=True, add_qkv_bias=False, window_size=None))
    assert gpt_model_args(hf)["rotary_base"] == 1000000
    assert gpt_model_args(hf)["vocab_size"] == 151936  # already a multiple of 128


def test_qwen3_30b_a3b():
    hf = AutoConfig.for_model("qwen3_moe", **QWEN3_30B_A3B)
    tc = hf_to_mcore_config(hf, McoreParallel(ep=8))
    _check(tc, dict(num_layers=48, num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                    moe_layer_freq=[1] * 48, moe_router_pre_softmax=False, moe_router_score_function="softmax",
                    moe_shared_expert_intermediate_size=None, moe_aux_loss_coeff=0.0,
                    moe_router_load_balancing_type="none", expert_model_parallel_size=8,
                    expert_tensor_parallel_size=1, moe_token_dispatcher_type="alltoall", qk_layernorm=True,
                    num_query_groups=4, kv_channels=128))
    # Aux loss is opt-in (RL default off); then it takes the HF coefficient.
    assert hf_to_mcore_config(hf, aux_loss=True).moe_aux_loss_coeff == 0.001


def test_deepseek_v3_mla(caplog):
    hf = AutoConfig.for_model("deepseek_v3", **DEEPSEEK_V3)
    with caplog.at_level(logging.WARNING, logger="actorcore.mcore.build.config"):
        tc = hf_to_mcore_config(hf)
    _check(tc, dict(multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                    qk_pos_emb_head_dim=64, v_head_dim=128, num_layers=61, num_attention_heads=128,
                    num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                    moe_shared_expert_intermediate_size=2048, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_num_groups=8, moe_router_group_topk=4,
                    moe_router_topk_scaling_factor=2.5, moe_layer_freq=[0, 0, 0] + [1] * 58, mtp_num_layers=1,
                    rope_type="yarn", rotary_scaling_factor=40.0, original_max_position_embeddings=4096,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, rotary_base=10000))
    # Fields the converter does not understand are named in one warning, not dropped silently.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "ep_size" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "seq_aux" in warnings[0] and "aux_loss_alpha" in warnings[0]


def test_mtp_config_fields_are_not_reported_unknown():
    """The fields ``build_gpt_model(..., mtp=True)`` reads (the MTP layer count, the refused dedicated embedding) are
    understood, for every architecture with MTP rules; a field nobody reads still is reported."""
    from actorcore.mcore.build.config import warn_unknown_fields
    from support.mtp import MTP_CONFIG_FIELDS
    from actorcore.testing.tiny_configs import tiny_config

    every_qwen3_next_field = dict(num_nextn_predict_layers=1, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    for model_type, fields in [*MTP_CONFIG_FIELDS.items(), ("qwen3_next", every_qwen3_next_field)]:
        assert warn_unknown_fields(tiny_config(model_type, **fields, made_up_field=3)) == ["made_up_field"], model_type


@pytest.mark.parametrize("model_type", [m for m in megatron_model_types() if get_spec(m).vision is None])
def test_tiny_configs_two_way(model_type):
    from actorcore.testing.tiny_configs import tiny_config

    hf = tiny_config(model_type)
    tc = hf_to_mcore_config(hf)
    args = gpt_model_args(hf)
    assert tc.num_layers == 2 and tc.hidden_size == 64 and tc.num_attention_heads == 4
    assert tc.num_query_groups == hf.num_key_value_heads
    assert args["vocab_size"] == 256  # 131 padded to a multiple of 128
    back = mcore_to_hf_config(tc, args, model_type, vocab_size=hf.vocab_size)
    rebuilt = AutoConfig.for_model(model_type, **back)
    for name, value in back.items():
        original = getattr(hf, name)
        assert original == value or (name == "mlp_only_layers" and not original and not value), name
    assert mcore_fields(rebuilt) == mcore_fields(hf)


def test_mistral_sliding_window_maps_to_window_size():
    from actorcore.testing.tiny_configs import tiny_config

    assert hf_to_mcore_config(tiny_config("mistral")).window_size == (6, 0)  # sliding_window=7


def test_router_normalisation():
    from actorcore.testing.tiny_configs import tiny_config

    assert hf_to_mcore_config(tiny_config("qwen2_moe")).moe_router_pre_softmax is True  # norm_topk_prob=False
    assert hf_to_mcore_config(tiny_config("qwen2_moe")).moe_shared_expert_gate is True
    assert hf_to_mcore_config(tiny_config("mixtral")).moe_router_pre_softmax is False  # always renormalises
    assert hf_to_mcore_config(tiny_config("qwen3_moe")).moe_layer_freq == [1, 0]  # mlp_only_layers=[1]


def test_rope_scaling_mapped_exactly_or_refused():
    from actorcore.testing.tiny_configs import tiny_config

    linear = tiny_config("llama", rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=5e5))
    assert gpt_model_args(linear)["seq_len_interpolation_factor"] == 4.0
    llama3 = tiny_config("llama", max_position_embeddings=16384,
                         rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=8192,
                                              rope_theta=5e5))
    args = gpt_model_args(llama3)
    assert args["rope_scaling"] is True and args["rope_scaling_factor"] == 8.0 and args["rotary_base"] == 5e5
    odd = tiny_config("llama", max_position_embeddings=16384,
                      rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192, rope_theta=5e5))
    with pytest.raises(UnsupportedConfigError, match="low_freq_factor"):
        gpt_model_args(odd)
    yarn = tiny_config("llama", rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4,
                                                     original_max_position_embeddings=128))
    assert gpt_model_args(yarn)["position_embedding_type"] == "yarn"
    assert hf_to_mcore_config(yarn).yarn_rotary_scaling_factor == 2.0
    for kind in ("dynamic", "longrope"):
        params = dict(rope_type=kind, factor=2.0, rope_theta=1e4, original_max_position_embeddings=128)
        if kind == "longrope":
            params.update(short_factor=[1.0] * 8, long_factor=[1.0] * 8)
        with pytest.raises(UnsupportedConfigError, match=kind):
            hf_to_mcore_config(tiny_config("llama", rope_parameters=params))


def test_gpt_oss_maps_its_compound_fields_and_refuses_what_megatron_lacks():
    from actorcore.mcore.build.config import SigmoidGate
    from actorcore.testing.tiny_configs import tiny_config

    hf = tiny_config("gpt_oss")
    tc = hf_to_mcore_config(hf)
    assert tc.softmax_type == "learnable" and tc.add_bias_linear
    assert tc.window_size == (4, 0) and tc.window_attn_skip_freq == [1, 0]  # sliding, then full
    assert tc.activation_func == SigmoidGate(1.5) and tc.activation_func_clamp_value == 3.0
    assert tc.glu_linear_offset == 1.0 and tc.gated_linear_unit and not tc.bias_activation_fusion
    assert (tc.yarn_rotary_scaling_factor, tc.yarn_beta_fast, tc.yarn_beta_slow) == (4.0, 16.0, 2.0)
    assert tc.yarn_correction_range_round_to_int is False and tc.yarn_original_max_position_embeddings == 64
    assert tc.moe_ffn_hidden_size == 88 and tc.moe_router_pre_softmax is False
    with pytest.raises(UnsupportedConfigError, match="context parallelism"):
        hf_to_mcore_config(hf, McoreParallel(cp=2))
    with pytest.raises(UnsupportedConfigError, match="attention_bias=False"):
        hf_to_mcore_config(tiny_config("gpt_oss", attention_bias=False))
    with pytest.raises(UnsupportedConfigError, match="attention_factor"):
        hf_to_mcore_config(tiny_config("gpt_oss", rope_parameters=dict(
            rope_type="yarn", rope_theta=5000.0, factor=4.0, original_max_position_embeddings=64,
            attention_factor=1.3)))


def test_refusals_are_clear():
    from actorcore.archs.spec import UnsupportedArchitectureError
    from actorcore.testing.tiny_configs import tiny_config

    with pytest.raises(UnsupportedConfigError, match="o_proj"):
        hf_to_mcore_config(tiny_config("llama", attention_bias=True))
    with pytest.raises(UnsupportedConfigError, match="rope_interleave"):
        hf_to_mcore_config(tiny_config("deepseek_v3", rope_interleave=False))
    with pytest.raises(UnsupportedConfigError, match="ranks groups"):
        hf_to_mcore_config(tiny_config("deepseek_v3", n_group=2, topk_group=2))
    with pytest.raises(UnsupportedConfigError, match="hidden_act"):
        hf_to_mcore_config(tiny_config("llama", hidden_act="gelu_new"))
    assert hf_to_mcore_config(tiny_config("qwen3_moe"), McoreParallel(tp=2)).expert_tensor_parallel_size == 1
    from actorcore.mcore.build.model import mcore_spec_for

    refused = refused_megatron_model_types()
    assert refused
    for model_type, reason in refused.items():
        config = SimpleNamespace(model_type=model_type)  # the decision is the spec's: no config field is read
        with pytest.raises(UnsupportedArchitectureError, match=re.escape(f"{model_type} is not supported on the "
                                                                         f"Megatron-Core route: {reason}")):
            mcore_spec_for(config)


def test_vlm_language_model_has_mrope_both_ways():
    """Qwen2.5-VL: the text config's mrope_section becomes Megatron's M-RoPE (and comes back); Qwen2's biases."""
    from actorcore.mcore.build.vlm import language_config
    from actorcore.testing.tiny_vlm import tiny_vlm_config

    text = language_config(tiny_vlm_config("qwen2_5_vl"))
    assert text.model_type == "qwen2_5_vl" and text.vocab_size == 131 and text.tie_word_embeddings is False
    tc, args = hf_to_mcore_config(text), gpt_model_args(text)
    assert args["position_embedding_type"] == "mrope" and tc.mrope_section == [2, 3, 3] and tc.add_qkv_bias
    back = mcore_to_hf_config(tc, args, "qwen2_5_vl_text", vocab_size=text.vocab_size)
    assert back["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert not uses_interleaved_mrope(text)
    interleaved = language_config(tiny_vlm_config("qwen3_vl"))  # Qwen3-VL's interleaved M-RoPE: our rotary module
    assert uses_interleaved_mrope(interleaved) and hf_to_mcore_config(interleaved).mrope_section == [2, 3, 3]
    assert hf_to_mcore_config(interleaved).qk_layernorm


def test_interleaved_mrope_frequency_rows_match_transformers():
    """The (t, h, w) row of every rotary frequency: transformers' Qwen3-VL recomposition, on a real section."""
    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from actorcore.mcore.build.rotary import InterleavedMultimodalRotaryEmbedding, interleaved_frequency_rows

    for section in ([24, 20, 20], [2, 3, 3], [4, 2, 2]):
        text = AutoConfig.for_model("qwen3_vl_text", head_dim=2 * sum(section), num_attention_heads=2, hidden_size=64,
                                    rope_parameters=dict(rope_type="default", rope_theta=500.0, mrope_section=section,
                                                         mrope_interleaved=True))
        hf = Qwen3VLTextRotaryEmbedding(text)
        positions_3BS = torch.randint(0, 50, (3, 1, 11), generator=torch.Generator().manual_seed(sum(section)))
        cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions_3BS)
        ours = InterleavedMultimodalRotaryEmbedding(hf.inv_freq)(positions_3BS, section)
        assert ours.shape == (11, 1, 1, 2 * sum(section))
        torch.testing.assert_close(ours[:, 0, 0].cos(), cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(ours[:, 0, 0].sin(), sin[0], atol=1e-6, rtol=0)
        rows = interleaved_frequency_rows(sum(section), section)
        assert set(rows.tolist()) == {0, 1, 2} and rows[0] == 0


@pytest.mark.parametrize("option, match", [(dict(value_head=True), "value head"),
                                           (dict(parallel=McoreParallel(cp=2)), "context parallelism")])
def test_vlm_refusals_are_clear(option, match):
    """Refused before anything is built (no parallel state needed)."""
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.testing.tiny_vlm import tiny_vlm_config

    with pytest.raises(ValueError, match=match):
        build_gpt_model(tiny_vlm_config("qwen2_5_vl"), **option)


def test_grouped_only_experts_refuse_the_per_expert_layout():
    """Qwen3-VL-MoE's checkpoints store the experts grouped only: that is its default layout, per-expert is refused
    before anything is built."""
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.testing.tiny_vlm import tiny_vlm_config

    assert get_spec("qwen3_vl_moe").mcore.uses_grouped_experts
    with pytest.raises(ValueError, match="grouped .*only: use expert_layout='grouped'"):
        build_gpt_model(tiny_vlm_config("qwen3_vl_moe"), expert_layout="per_expert")


def test_qwen2_5_vl_7b_hub_config():
    """Qwen2.5-VL-7B-Instruct's config.json (text fields at the top, ``rope_scaling`` of type ``mrope``)."""
    from transformers import AutoConfig

    from actorcore.mcore.build.vlm import language_config

    hub = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_hidden_layers=28,
               num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=152064, sliding_window=32768,
               use_sliding_window=False, max_position_embeddings=128000, tie_word_embeddings=False,
               rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, image_token_id=151655,
               video_token_id=151656, vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420,
                                                         num_heads=16, out_hidden_size=3584, window_size=112,
                                                         fullatt_block_indexes=[7, 15, 23, 31]))
    text = language_config(AutoConfig.for_model("qwen2_5_vl", **hub))
    tc, args = hf_to_mcore_config(text, McoreParallel(tp=4)), gpt_model_args(text)
    assert (tc.num_layers, tc.hidden_size, tc.num_query_groups, tc.kv_channels) == (28, 3584, 4, 128)
    assert tc.mrope_section == [16, 24, 24] and tc.window_size is None and tc.add_qkv_bias
    assert args["position_embedding_type"] == "mrope" and args["rotary_base"] == 1e6
    assert args["vocab_size"] == 152064 and args["share_embeddings_and_output_weights"] is False


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "kimi_k25"])  # kimi_k25: tower + projector, fused qkv
def test_vision_tower_replicas_start_equal_and_leave_the_rng_alone(model_type):
    """Every rank builds the same tower before loading (a fixed seed), without moving the caller's RNG."""
    from actorcore.mcore.build.vlm import build_vision_tower
    from actorcore.testing.tiny_vlm import tiny_vlm_config

    config = tiny_vlm_config(model_type)
    towers, draws = [], []
    for seed in (5, 7):
        torch.manual_seed(seed)
        towers.append(build_vision_tower(config, torch.float32, "cpu"))
        draws.append(torch.rand(3))
        torch.manual_seed(seed)
        assert torch.equal(draws[-1], torch.rand(3))
    assert all(torch.equal(a, b) for a, b in zip(towers[0].state_dict().values(), towers[1].state_dict().values()))


def test_cp_comm_type_selects_the_ring_or_the_all_gather_and_refuses_the_rest():
    from actorcore.mcore.build.attention import PackedCoreAttention, uses_cp_ring

    hf = AutoConfig.for_model("qwen3", **QWEN3_8B)
    # Not asked: Megatron's TransformerConfig default (None), which means the all-gather.
    assert hf_to_mcore_config(hf, McoreParallel(cp=2)).cp_comm_type is None
    assert not uses_cp_ring(None) and not uses_cp_ring("all_gather") and uses_cp_ring("p2p")
    # build_gpt_model(..., cp_comm_type=...) passes it through to the TransformerConfig.
    assert hf_to_mcore_config(hf, McoreParallel(cp=2), cp_comm_type="p2p").cp_comm_type == "p2p"
    for refused in ("a2a", "a2a+p2p", ["p2p"] * 36):
        config = hf_to_mcore_config(hf, McoreParallel(cp=2), cp_comm_type=refused)
        with pytest.raises(ValueError, match="cp_comm_type=.* is not supported.*'all_gather'.*'p2p'"):
            PackedCoreAttention(config, 1, None, "self")


def test_the_megatron_route_refuses_logit_transforms_it_does_not_apply(monkeypatch):
    """The Megatron route runs the HF route's config check (an undeclared head transform is refused before anything
    is built), and refuses a declared one that is active: its head applies none."""
    import actorcore.mcore.build.model as mcore_model
    from actorcore.archs import HeadTransform
    from actorcore.mcore import build_gpt_model
    from actorcore.testing.tiny_configs import tiny_config

    config = tiny_config("qwen3")
    config.logits_scaling = 4.0
    with pytest.raises(UnsupportedArchitectureError, match=r"config.logits_scaling=4.0 changes the logits"):
        build_gpt_model(config)
    declared = dataclasses.replace(get_spec("qwen3"), head=(HeadTransform("divide", "logits_scaling"),))
    monkeypatch.setattr(mcore_model, "get_spec", lambda model_type: declared)
    with pytest.raises(UnsupportedArchitectureError, match=r"logits_scaling=4.0 .* Megatron route's head does not"):
        mcore_model.mcore_spec_for(config)
    config.logits_scaling = 1.0  # neutral: nothing to apply
    assert mcore_model.mcore_spec_for(config) is declared.mcore
