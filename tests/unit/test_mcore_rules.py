"""Mapping rules as data: completeness (every HF tensor matched by exactly one rule and no rule matching no
tensor, every Megatron arch),
pure transforms (QKV / gate-up merge and split, TP / EP slicing) exact, rule validation."""

from __future__ import annotations

import os
import re

import pytest
import torch

from actorcore.archs import get_spec, registered_model_types
from actorcore.archs.megatron_rules import McoreSpec, WeightRule
from actorcore.mcore.convert import transforms as T
from actorcore.mcore.build.model import megatron_model_types, refused_megatron_model_types
from support.docs import doc_between


def test_megatron_archs_and_refusals_are_declared():
    """The registry's Megatron decision for every architecture is explicit, and docs/megatron.md's table of
    supported and refused architectures is exactly the registry's (the list is written once, in the specs)."""
    for model_type in registered_model_types():
        mcore = get_spec(model_type).mcore
        assert bool(mcore.rules) != bool(mcore.refused), model_type
    supported, refused = _documented_archs()
    assert sorted(supported) == sorted(megatron_model_types())
    assert sorted(refused) == sorted(refused_megatron_model_types())


def _documented_archs() -> tuple[list[str], list[str]]:
    """model_types named in the first column of docs/megatron.md's "Supported architectures" table."""
    text = doc_between("docs/megatron.md", "## Supported architectures", "\n## ")
    supported, refused = [], []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[1] or cells[1].startswith("-") or cells[0] == "model_type":
            continue
        names = re.findall(r"(?:^|, )([a-z0-9_]+)", re.sub(r"\([^)]*\)", "", cells[0]))
        if cells[1].startswith("yes"):
            supported += names
        elif cells[1].startswith("refused"):
            refused += names
    return supported, refused


def _disk_names(model, tmp_path) -> list[str]:
    from safetensors import safe_open

    model.save_pretrained(str(tmp_path))
    with safe_open(os.path.join(str(tmp_path), "model.safetensors"), "pt") as f:
        return list(f.keys())


def _tiny_models(model_type: str, overrides: dict) -> list:
    """The architecture's tiny models whose checkpoints the rules must cover: the causal LM and the critic
    (a VLM: the ``...ForConditionalGeneration`` only; it has no critic; nor has an architecture without a
    ``...ForTokenClassification`` in transformers, e.g. glm4_moe or qwen3_5_text)."""
    from actorcore.archs import get_spec
    from actorcore.testing.tiny_configs import build_tiny_model, has_critic_class

    if get_spec(model_type).vision is not None:
        from actorcore.testing.tiny_vlm import build_tiny_vlm

        return [build_tiny_vlm(model_type, **overrides)]
    tasks = ("causal_lm", "token_classification") if has_critic_class(model_type) else ("causal_lm",)
    return [build_tiny_model(model_type, task=task, **overrides) for task in tasks]


# Config variants that exercise rules the tiny config leaves unused (qwen2_moe: a dense MLP layer).
RULE_VARIANTS = {"qwen2_moe": [dict(mlp_only_layers=[1])], "kimi_k25": [dict(tie_word_embeddings=False)]}
# Rules the spec declares but the architecture cannot use; fixing them is a change to the arch spec.
@pytest.mark.parametrize("model_type", megatron_model_types())
def test_every_hf_tensor_matched_by_exactly_one_rule(model_type, tmp_path):

    spec = get_spec(model_type).mcore
    for i, overrides in enumerate([{}, *RULE_VARIANTS.get(model_type, [])]):
        for j, model in enumerate(_tiny_models(model_type, overrides)):
            names = _disk_names(model, tmp_path / f"{j}-{i}")
            assert names
            rules = spec.for_checkpoint(names)  # under the names save_pretrained writes (Kimi-K2.5: not the release's)
            for name in names:
                hits = rules.rules_for_hf(name)
                assert len(hits) == 1, f"{model_type} {type(model).__name__} {overrides}: {name} matched by " \
                    f"{len(hits)} rules"


@pytest.mark.parametrize("model_type", megatron_model_types())
def test_no_dead_rules(model_type, tmp_path):
    """Every rule (per-expert and grouped) matches at least one tensor of the architecture's tiny models: the
    causal LM and the critic on disk (and the variants above), and, for grouped rules, the in-memory layout."""

    spec = get_spec(model_type).mcore
    names: set[str] = set()
    for i, overrides in enumerate([{}, *RULE_VARIANTS.get(model_type, [])]):
        for j, model in enumerate(_tiny_models(model_type, overrides)):
            names |= set(_disk_names(model, tmp_path / f"{j}-{i}"))
    stored = spec.for_checkpoint(names)
    dead = [rule.mcore_name for rule in stored.rules if not any(rule.match_hf(n) is not None for n in names)]
    in_memory = set(_tiny_models(model_type, {})[0].state_dict())
    dead += [rule.mcore_name for rule in spec.grouped_expert_rules
             if not any(rule.match_hf(n) is not None for n in in_memory)]
    assert not dead, f"{model_type}: rules that match no tensor of its tiny models: {dead}"


def test_rule_patterns_resolve_indices():
    spec = get_spec("mixtral").mcore
    rule, idx = spec.rule_for_mcore("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
    assert idx == {"layer": 1, "expert": 3} and rule.parallel == "expert" and rule.transform == "gate_up"
    assert rule.hf_names_for(idx) == ("model.layers.1.block_sparse_moe.experts.3.w1.weight",
                                      "model.layers.1.block_sparse_moe.experts.3.w3.weight")
    with pytest.raises(KeyError, match="matches 0 mapping rules"):
        spec.rule_for_mcore("decoder.layers.0.self_attention.unknown.weight")
    tied, _ = spec.rule_for_mcore("output_layer.weight")
    assert tied.hf_names_for({}, tied=True) == ("model.embed_tokens.weight",)


def test_mtp_rules_map_both_release_layouts():
    """An MTP layer's Megatron names map to where each release layout stores it: DeepSeek-V3's extra decoder layer
    ``model.layers.{N + i}``, Qwen3-Next's / Qwen3.5's ``mtp.*`` head (``fc`` is ``eh_proj``, the decoder layer under
    ``mtp.layers.{i}``); a checkpoint's MTP tensors are found as such (dropped when built without MTP), an extra layer
    is not."""
    from actorcore.mcore.convert.load import _mtp_tensors
    from actorcore.testing.tiny_configs import tiny_config

    deepseek, qwen = get_spec("deepseek_v3").mcore, get_spec("qwen3_next").mcore
    rule, idx = deepseek.with_mtp().rule_for_mcore("mtp.layers.2.transformer_layer.mlp.router.weight")
    assert rule.hf_names_for(idx) == ("model.layers.2.mlp.gate.weight",)
    for mcore, hf in [("mtp.layers.0.eh_proj.weight", ("mtp.fc.weight",)),
                      ("mtp.layers.0.enorm.weight", ("mtp.pre_fc_norm_embedding.weight",)),
                      ("mtp.layers.0.hnorm.weight", ("mtp.pre_fc_norm_hidden.weight",)),
                      ("mtp.layers.0.final_layernorm.weight", ("mtp.norm.weight",)),
                      ("mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight",
                       ("mtp.layers.0.mlp.experts.3.down_proj.weight",)),
                      ("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight",
                       tuple(f"mtp.layers.0.self_attn.{p}_proj.weight" for p in "qkv"))]:
        rule, idx = qwen.with_mtp().rule_for_mcore(mcore)
        assert rule.hf_names_for(idx) == hf, mcore
    assert qwen.mtp.hf_layers(48, 1) == range(0, 1) and deepseek.mtp.hf_layers(61, 1) == range(61, 62)
    names = {"mtp.fc.weight", "mtp.layers.0.input_layernorm.weight", "model.norm.weight",
             "model.layers.0.mlp.gate.weight"}
    assert _mtp_tensors(qwen, names, tiny_config("qwen3_next")) == ["mtp.fc.weight",
                                                                   "mtp.layers.0.input_layernorm.weight"]
    names = {"model.layers.2.enorm.weight", "model.layers.2.mlp.gate.weight", "model.layers.2.embed_tokens.weight",
             "model.layers.3.mlp.gate.weight", "model.layers.1.mlp.gate.weight"}
    assert _mtp_tensors(deepseek, names, tiny_config("deepseek_v3", num_nextn_predict_layers=1)) == [
        "model.layers.2.embed_tokens.weight", "model.layers.2.enorm.weight", "model.layers.2.mlp.gate.weight"]


def test_rules_validate_themselves():
    with pytest.raises(ValueError, match="parallel"):
        WeightRule("a.weight", ("b.weight",), parallel="diagonal")
    with pytest.raises(ValueError, match="takes 3 HF names"):
        WeightRule("a.weight", ("q", "k"), transform="qkv")
    with pytest.raises(ValueError, match="per-expert"):
        WeightRule("decoder.layers.{layer}.mlp.experts.local_experts.{expert}.w", ("x.{expert}",))
    duplicate = McoreSpec(rules=(WeightRule("a.weight", ("b.weight",)), WeightRule("a.weight", ("c.weight",))))
    with pytest.raises(KeyError, match="matches 2"):
        duplicate.rule_for_mcore("a.weight")


def test_merge_split_qkv_is_grouped_and_exact():
    heads, groups, dim, hidden = 4, 2, 3, 5
    q = torch.arange(heads * dim * hidden, dtype=torch.float32).reshape(heads * dim, hidden)
    k = -torch.arange(groups * dim * hidden, dtype=torch.float32).reshape(groups * dim, hidden) - 1
    v = k - 1000
    fused = T.merge_qkv(q, k, v, groups)
    # Group 0 holds q heads 0-1, then k head 0, then v head 0.
    assert torch.equal(fused[: 2 * dim], q[: 2 * dim])
    assert torch.equal(fused[2 * dim: 3 * dim], k[:dim])
    assert torch.equal(fused[3 * dim: 4 * dim], v[:dim])
    for a, b in zip(T.split_qkv(fused, heads, groups), (q, k, v)):
        assert torch.equal(a, b)
    # Sharding the parts then merging == slicing the fused tensor (the layout is per query group).
    for rank in range(2):
        parts = [T.shard_for_tp(x, "column", rank, 2) for x in (q, k, v)]
        assert torch.equal(T.merge_qkv(*parts, groups // 2), T.shard_for_tp(fused, "column", rank, 2))
    bias = T.merge_qkv(q[:, 0], k[:, 0], v[:, 0], groups)
    assert torch.equal(bias, fused[:, 0])


def test_gate_up_shards_each_part():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    shards = [T.merge_gate_up(T.shard_for_tp(gate, "column", r, 2), T.shard_for_tp(up, "column", r, 2))
              for r in range(2)]
    assert torch.equal(shards[0], torch.cat([gate[:3], up[:3]]))
    back = [T.split_gate_up(s) for s in shards]
    assert torch.equal(torch.cat([b[0] for b in back]), gate) and torch.equal(torch.cat([b[1] for b in back]), up)


def test_tp_slicing_styles_round_trip():
    x = torch.randn(10, 6)
    for style in ("column", "row", "replicated"):
        shards = [T.shard_for_tp(x, style, r, 2) for r in range(2)]
        assert torch.equal(T.unshard_for_tp(shards, style), x)
    assert T.shard_for_tp(x, "row", 1, 2).shape == (10, 3)
    vocab = [T.shard_for_tp(x, "vocab", r, 2, padded_rows=16) for r in range(2)]
    assert vocab[1].shape == (8, 6) and torch.equal(vocab[1][2:], torch.zeros(6, 6))
    assert torch.equal(T.unshard_for_tp(vocab, "vocab", vocab_size=10), x)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        T.shard_for_tp(torch.randn(5, 2), "column", 0, 2)


def test_expert_ranges():
    assert list(T.local_experts(8, 1, 4)) == [2, 3]
    with pytest.raises(ValueError, match="experts"):
        T.local_experts(6, 0, 4)


# Architectures whose checkpoints come in both expert layouts (gpt-oss's come only grouped: its rules are grouped).
TWO_LAYOUTS = [m for m in megatron_model_types()
               if get_spec(m).mcore.grouped_expert_rules and not get_spec(m).mcore.uses_grouped_experts]


@pytest.mark.parametrize("model_type", TWO_LAYOUTS)
def test_grouped_expert_layout_matched_by_exactly_one_rule(model_type):
    """transformers 5's in-memory names (experts stacked in gate_up_proj / down_proj) under the grouped rules."""
    from actorcore.testing.tiny_configs import build_tiny_model

    spec = get_spec(model_type).mcore
    names = list(build_tiny_model(model_type).state_dict())
    assert any(n.endswith("experts.gate_up_proj") for n in names)
    grouped = spec.for_checkpoint(names)
    assert grouped.uses_grouped_experts and not spec.uses_grouped_experts
    for name in names:
        assert len(grouped.rules_for_hf(name)) == 1, f"{model_type}: {name}"
    rule, idx = grouped.rule_for_mcore("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight")
    assert rule.grouped and rule.hf_names_for(idx) == ("model.layers.0.mlp.experts.down_proj",)


def test_grouped_rules_validate():
    with pytest.raises(ValueError, match="grouped"):
        WeightRule("decoder.layers.{layer}.mlp.experts.local_experts.{expert}.w", ("x.{expert}",), parallel="expert",
                   grouped=True)
    with pytest.raises(ValueError, match="no grouped expert rules"):
        get_spec("llama").mcore.with_grouped_experts()


def test_vlm_checkpoints_with_in_memory_names():
    """Qwen2.5-VL checkpoints saved by transformers 4.52-4.57 store the in-memory names (``model.language_model.*``,
    ``model.visual.*``): ``for_checkpoint`` renames the rules for them; the released names keep the rules as they are."""
    from actorcore.testing.tiny_vlm import build_tiny_vlm

    spec = get_spec("qwen2_5_vl").mcore
    in_memory = list(build_tiny_vlm("qwen2_5_vl").state_dict())
    assert any(n.startswith("model.language_model.") for n in in_memory)
    renamed = spec.for_checkpoint(in_memory)
    for name in in_memory:
        assert len(renamed.rules_for_hf(name)) == 1, name
    rule, idx = renamed.rule_for_mcore("decoder.layers.1.self_attention.linear_qkv.bias")
    assert rule.hf_names_for(idx)[0] == "model.language_model.layers.1.self_attn.q_proj.bias"
    assert renamed.rule_for_mcore("vision_tower.merger.ln_q.weight")[0].hf_names == ("model.visual.merger.ln_q.weight",)
    assert renamed.rule_for_mcore("output_layer.weight")[0].hf_names == ("lm_head.weight",)
    assert spec.for_checkpoint(["model.layers.0.input_layernorm.weight", "visual.patch_embed.proj.weight"]) is spec
