"""The architecture contract: specs state their Megatron part, head transforms are spec data that the tiny
configs exercise, an undeclared head transform is refused, and ``register_arch`` proves a spec with ``verify``."""

import dataclasses

import pytest
import torch

import actorcore as ac
from actorcore.archs import (
    ArchSpec,
    HeadTransform,
    Registry,
    UnsupportedArchitectureError,
    check_config,
    get_spec,
    registered_model_types,
    registry,
    text_config,
)
from actorcore.archs.megatron_rules import DENSE_RULES, McoreSpec
from actorcore.archs.spec import HEAD_CONFIG_FIELDS
from actorcore.testing.tiny_configs import REPRESENTATIVE_ARCHS, TINY_CONFIGS, build_tiny_model, tiny_config
from actorcore.testing.tiny_vlm import TINY_VLM_CONFIGS, tiny_vlm_config
from actorcore.testing.tolerances import TOL

REFUSED_ONLY = {m for m in registered_model_types() if get_spec(m).vision is not None and get_spec(m).vision.refused}


def _tiny(model_type):
    return tiny_vlm_config(model_type) if get_spec(model_type).vision is not None else tiny_config(model_type)


def test_every_registered_architecture_has_a_tiny_config():
    missing = [m for m in registered_model_types()
               if m not in REFUSED_ONLY and m not in TINY_CONFIGS and m not in TINY_VLM_CONFIGS]
    assert not missing, f"architectures without a tiny config in actorcore.testing.tiny_configs / tiny_vlm: {missing}"


@pytest.mark.parametrize("model_type", sorted(set(registered_model_types()) - REFUSED_ONLY))
def test_tiny_configs_exercise_every_head_transform(model_type):
    """A head field the tiny config leaves neutral (a multiplier of 1.0) would hide a missing transform."""
    config = text_config(_tiny(model_type))
    for transform in get_spec(model_type).head:
        value = getattr(config, transform.field, None)
        assert not transform.is_neutral(value), f"{model_type}: tiny config leaves {transform.field}={value!r}"
    for field_name, op in HEAD_CONFIG_FIELDS.items():
        if hasattr(config, field_name):
            value = getattr(config, field_name)
            assert not HeadTransform(op, field_name).is_neutral(value), \
                f"{model_type}: its config has {field_name} but the tiny config leaves it {value!r}"


def _partial_rope(config):
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) < 1.0


def test_representative_archs_cover_what_varies():
    """The set that architecture-independent features run over has each variation the text architectures have."""
    text = [m for m in registered_model_types() if get_spec(m).vision is None]
    reps = sorted(REPRESENTATIVE_ARCHS)
    assert set(reps) <= set(text) and set(reps) <= set(TINY_CONFIGS)
    specs, configs = {m: get_spec(m) for m in text}, {m: tiny_config(m) for m in text}
    assert {t.op for m in text for t in specs[m].head} <= {t.op for m in reps for t in specs[m].head}
    for name, has in {"tied head": lambda m: configs[m].tie_word_embeddings,
                      "MoE": lambda m: specs[m].mlp_kind == "moe",
                      "hybrid (linear attention)": lambda m: specs[m].linear_attention is not None,
                      "partial RoPE": lambda m: _partial_rope(configs[m])}.items():
        assert any(has(m) for m in text), name
        assert any(has(m) for m in reps), f"no representative architecture has a {name}"


def test_specs_state_their_megatron_part():
    with pytest.raises(ValueError, match="must state its Megatron part"):
        ArchSpec(model_type="newarch")
    llama = get_spec("llama")
    derived = dataclasses.replace(llama, model_type="newarch")  # inherits llama's rules silently
    with pytest.raises(ValueError, match="shares its Megatron part with 'llama'"):
        Registry({"llama": llama, "newarch": derived})
    Registry({"llama": llama, "newarch": dataclasses.replace(llama, model_type="newarch",
                                                             mcore=McoreSpec(rules=DENSE_RULES))})


def test_shipped_specs_share_no_megatron_part():
    specs = [get_spec(m) for m in registered_model_types()]
    assert len({id(s.mcore) for s in specs}) == len(specs)


def test_undeclared_head_transform_is_refused():
    config = tiny_config("granite")
    bare = dataclasses.replace(get_spec("granite"), head=(), mcore=McoreSpec(refused="test"))
    with pytest.raises(UnsupportedArchitectureError, match=r"config.logits_scaling=4.0 changes the logits"):
        check_config(bare, config)
    check_config(get_spec("granite"), config)
    config.logits_scaling = 1.0  # neutral: nothing to apply
    check_config(bare, config)


def test_granite_head_transform_is_applied():
    """Granite divides its logits by logits_scaling in its own forward; the fused head must too."""
    model = build_tiny_model("granite")
    ids = torch.randint(3, 131, (1, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = ac.compute_logprobs(model, ac.pack([ids[0]]), temperature=0.7)
        logits = model(input_ids=ids).logits[0].float() / 0.7
    want = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    assert (out.log_probs[1:] - want).abs().max().item() <= TOL["packed_vs_hf_fp32"]


@pytest.fixture
def restore_granite():
    shipped = get_spec("granite")
    yield shipped
    registry().remove("granite", restore=shipped)


def test_register_arch_proves_the_spec(restore_granite):
    config = tiny_config("granite")
    spec = dataclasses.replace(restore_granite, mcore=McoreSpec(refused="user spec"))
    report = ac.register_arch(spec, config, replace=True)
    assert report.ok and get_spec("granite") is spec


def test_register_arch_refuses_what_verify_catches(restore_granite, monkeypatch):
    """A head transform that no table knows of (simulated by forgetting logits_scaling) is caught by verify."""
    from actorcore.hf.verify import VerificationError

    monkeypatch.delitem(HEAD_CONFIG_FIELDS, "logits_scaling")
    spec = dataclasses.replace(restore_granite, head=(), mcore=McoreSpec(refused="user spec"))
    with pytest.raises(VerificationError):
        ac.register_arch(spec, tiny_config("granite"), replace=True)
    assert get_spec("granite") is restore_granite, "a spec that failed verification must not stay registered"


def test_register_arch_shrinks_a_real_sized_config(restore_granite):
    from transformers import AutoConfig

    big = AutoConfig.for_model("granite", hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=49155,
                               logits_scaling=8.0, attention_multiplier=0.015625, embedding_multiplier=12.0,
                               residual_multiplier=0.22)
    spec = dataclasses.replace(restore_granite, mcore=McoreSpec(refused="user spec"))
    report = ac.register_arch(spec, big, replace=True)
    assert report.ok
    assert big.num_hidden_layers == 40, "the caller's config is not modified"


@pytest.mark.parametrize("model_type",
                         [m for m in registered_model_types() if get_spec(m).linear_attention is not None])
def test_hybrid_tiny_configs_mix_layer_kinds_and_shapes(model_type):
    """A hybrid tiny config has both layer kinds, and linear-attention heads and dims unlike the attention's (a
    swapped key/value count or dim would otherwise go unseen), key heads shared by several value heads, a
    non-default conv width and partial RoPE."""
    linear = get_spec(model_type).linear_attention
    config = text_config(_tiny(model_type))
    types = getattr(config, linear.layer_types_field)
    assert linear.layer_type in types and any(t != linear.layer_type for t in types)
    heads = (config.linear_num_key_heads, config.linear_num_value_heads)
    assert heads[0] < heads[1] and heads != (config.num_key_value_heads, config.num_attention_heads)
    assert config.linear_key_head_dim != config.linear_value_head_dim
    assert config.linear_conv_kernel_dim != 4
    assert config.rope_parameters["partial_rotary_factor"] not in (None, 0.25, 1.0)
