"""Weight-mapping rules between Hugging Face and Megatron-Core names, as data (no megatron import).

A rule maps one Megatron parameter (a name pattern) to the Hugging Face tensor(s) it is made of, says how
they combine (``transform``) and how the result is distributed (``parallel``). Patterns use ``{layer}``
(global decoder layer index) and ``{expert}`` (global expert index). The arch specs hold tuples of rules;
generic code in ``mcore/`` reads them. Names are the on-disk safetensors names.

Parallel styles:
  ``column``      split over tensor-parallel ranks along dim 0 (each HF part separately, then merged)
  ``row``         split over tensor-parallel ranks along dim 1
  ``vocab``       split along dim 0 over tensor-parallel ranks after padding the vocabulary
  ``replicated``  the full tensor on every rank
  ``expert``      whole tensor on the expert-parallel rank that owns ``{expert}`` (expert TP is 1)

A ``column`` rule with ``sections`` splits a tensor made of several blocks along dim 0 (a Gated DeltaNet's
``[q; k; v]`` channels) block by block: each TP rank holds its slice of every block, in block order. The
sections are named (``SECTION_SIZES``) and sized from the HF config by the Megatron route.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from actorcore._moved import renamed

MLP_ACTIVATIONS = ("hidden_act", "clamped_swiglu")
PARALLEL_STYLES = ("column", "row", "vocab", "replicated", "expert")
# rename: one tensor as is; qkv: q, k, v fused per query group; gate_up: [gate; up] stacked on dim 0;
# gated_qkv: q_proj holding [q_h; gate_h] per head, k, v fused per query group as [q; gate; k; v] (Megatron's
# attention_output_gate layout).
# transpose: HF stores the weight input-dim first (``[in, out]``, gpt-oss's fused experts), Megatron ``[out, in]``;
# interleaved_gate_up: HF's last dim alternates gate and up columns (gpt-oss's ``gate_up_proj`` ``[D, 2F]`` per
# expert and its bias ``[2F]``), Megatron's fc1 is ``[gate; up]`` on dim 0 (the weight transposed to ``[2F, D]``).
TRANSFORMS = ("rename", "qkv", "gate_up", "gated_qkv", "transpose", "interleaved_gate_up")
# Named blocks of a sectioned tensor: the HF config fields whose product is the block's rows.
SECTION_SIZES = {
    "linear_key": ("linear_num_key_heads", "linear_key_head_dim"),
    "linear_value": ("linear_num_value_heads", "linear_value_head_dim"),
}
_PLACEHOLDER = re.compile(r"\{(layer|expert)\}")


def _pattern_regex(pattern: str) -> re.Pattern:
    parts = _PLACEHOLDER.split(pattern)
    out = []
    for i, part in enumerate(parts):
        out.append(f"(?P<{part}>\\d+)" if i % 2 else re.escape(part))
    return re.compile("".join(out) + r"\Z")


@dataclass(frozen=True)
class WeightRule:
    """One Megatron parameter and the HF tensor(s) it is built from."""

    mcore_name: str
    hf_names: tuple[str, ...]
    transform: str = "rename"
    parallel: str = "replicated"
    # Tied embeddings: when the config ties input and output embeddings, read/write this HF name instead
    # (HF checkpoints do not store the tied lm_head).
    tied_hf_name: str | None = None
    # Grouped experts: the HF tensor stacks every expert on dim 0 (``[E, ...]``, transformers 5's in-memory
    # layout); Megatron's per-expert parameter ``{expert}`` is row ``expert`` of it.
    grouped: bool = False
    # Blocks along dim 0 split over TP one by one (names of SECTION_SIZES); only for column rules.
    sections: tuple[str, ...] = ()
    # Megatron holds this tensor in float32 whatever the model's dtype (the router's expert bias, a float32 buffer),
    # and releases store it so beside 16-bit weights: a checkpoint may hold it in float32 (it is loaded bit-exact),
    # and export writes it in float32.
    keeps_fp32: bool = False

    def __post_init__(self) -> None:
        if self.parallel not in PARALLEL_STYLES:
            raise ValueError(f"{self.mcore_name}: parallel {self.parallel!r} is not one of {PARALLEL_STYLES}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"{self.mcore_name}: transform {self.transform!r} is not one of {TRANSFORMS}")
        expected = {"qkv": 3, "gate_up": 2, "gated_qkv": 3}.get(self.transform, 1)
        if len(self.hf_names) != expected:
            raise ValueError(f"{self.mcore_name}: transform {self.transform} takes {expected} HF names")
        if ("{expert}" in self.mcore_name) != (self.parallel == "expert"):
            raise ValueError(f"{self.mcore_name}: exactly the per-expert rules use parallel='expert'")
        if self.grouped and (self.parallel != "expert" or any("{expert}" in n for n in self.hf_names)):
            raise ValueError(f"{self.mcore_name}: a grouped rule maps per-expert parameters to HF tensors "
                             "without an {expert} index")

        if self.sections and (self.parallel != "column" or self.transform != "rename"
                              or any(s not in SECTION_SIZES for s in self.sections)):
            raise ValueError(f"{self.mcore_name}: sections {self.sections} need a column rename rule and names "
                             f"from {sorted(SECTION_SIZES)}")

    def match_mcore(self, name: str) -> dict[str, int] | None:
        found = _pattern_regex(self.mcore_name).match(name)
        return {k: int(v) for k, v in found.groupdict().items()} if found else None

    def match_hf(self, name: str) -> dict[str, int] | None:
        """Indices if ``name`` is one of this rule's own HF tensors (the tied alias belongs to its own rule)."""
        for pattern in self.hf_names:
            found = _pattern_regex(pattern).match(name)
            if found:
                return {k: int(v) for k, v in found.groupdict().items()}
        return None

    def hf_names_for(self, indices: dict[str, int], tied: bool = False) -> tuple[str, ...]:
        names = (self.tied_hf_name,) if tied and self.tied_hf_name else self.hf_names
        return tuple(n.format(**indices) for n in names)


@dataclass(frozen=True)
class McoreSpec:
    """The Megatron part of an arch spec.

    ``config_overrides``: TransformerConfig fields fixed by the architecture (not read from the HF config),
    e.g. ``add_qkv_bias=True`` for Qwen2. ``refused``: why this architecture cannot use the Megatron route
    (then ``rules`` is empty and every entry point raises with this reason).
    """

    rules: tuple[WeightRule, ...] = ()
    config_overrides: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None
    # Alternative expert rules for checkpoints that store the experts grouped (``grouped=True`` rules);
    # ``for_checkpoint`` picks them when the checkpoint has such tensors.
    grouped_expert_rules: tuple[WeightRule, ...] = ()
    # Other names some checkpoints store: ``(prefix in the rules, prefix stored instead)`` pairs, e.g. Qwen2.5-VL
    # saved by transformers 4.52-4.57 (``model.language_model.`` for ``model.``); ``for_checkpoint`` renames the
    # rules' HF names when the checkpoint uses them (every pair at once; export keeps the rules' names).
    stored_prefixes: tuple[tuple[str, str], ...] = ()
    # Multi-token prediction, used when the model is built with MTP layers: see ``MtpRules``.
    mtp: "MtpRules | None" = None
    # HF config fields this architecture maps one-to-one onto TransformerConfig fields, both ways (``(hf, mcore)``
    # pairs), where the generic table cannot: e.g. GLM-4.5's ``attention_bias`` biases q, k and v only
    # (``add_qkv_bias``), while Llama's also biases o_proj.
    config_fields: tuple[tuple[str, str], ...] = ()
    # RoPE on the first ``partial_rotary_factor`` of each head's dims, non-interleaved (Megatron's rotary_percent).
    partial_rotary: bool = False
    # A text model whose M-RoPE sections (``rope_parameters.mrope_section``) always see the same position: plain RoPE.
    text_mrope: bool = False
    # The MLP activation (``MLP_ACTIVATIONS``): "hidden_act", the config's ``hidden_act`` as a GLU; "clamped_swiglu",
    # gpt-oss's experts: gate clamped above and up clamped to +-swiglu_limit, gate * sigmoid(swiglu_alpha * gate)
    # * (up + 1) (the config's ``hidden_act`` is not used).
    activation: str = "hidden_act"
    # A learned logit per attention head in every softmax denominator (gpt-oss's ``self_attn.sinks``): Megatron's
    # ``softmax_type="learnable"`` (its ``core_attention.softmax_offset``).
    attention_sinks: bool = False
    # HF tensors (name suffixes) that the architecture's releases store as MXFP4 (fused experts ``[E, in, out]``):
    # export re-quantises them on request (``export.mxfp4``); loading dequantises whatever the checkpoint stores.
    mxfp4_weights: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {MLP_ACTIVATIONS}")

    def for_checkpoint(self, hf_names: set[str] | list[str]) -> "McoreSpec":
        """This spec with the names (``stored_prefixes``) and the expert rules (per-expert or grouped) that fit the
        checkpoint's layout."""
        spec = self
        if any(n.startswith(stored) for _, stored in self.stored_prefixes for n in hf_names):
            spec = self.with_stored_prefixes()
        grouped = [r for r in spec.grouped_expert_rules if any(r.match_hf(n) is not None for n in hf_names)]
        return spec.with_grouped_experts() if grouped else spec

    def with_stored_prefixes(self) -> "McoreSpec":
        def rename(name: str | None) -> str | None:
            for prefix, stored in self.stored_prefixes:
                if name is not None and name.startswith(prefix):
                    return stored + name[len(prefix):]
            return name

        def renamed(rules: tuple[WeightRule, ...]) -> tuple[WeightRule, ...]:
            return tuple(dataclasses.replace(r, hf_names=tuple(rename(n) for n in r.hf_names),
                                             tied_hf_name=rename(r.tied_hf_name)) for r in rules)

        return dataclasses.replace(self, rules=renamed(self.rules),
                                   grouped_expert_rules=renamed(self.grouped_expert_rules), stored_prefixes=())

    def with_grouped_experts(self) -> "McoreSpec":
        if not self.grouped_expert_rules and self.uses_grouped_experts:
            return self  # an architecture whose checkpoints store the experts grouped only (its rules are grouped)
        if not self.grouped_expert_rules:
            raise ValueError("this architecture declares no grouped expert rules")
        per_expert = {r.mcore_name for r in self.grouped_expert_rules}
        kept = tuple(r for r in self.rules if r.mcore_name not in per_expert)
        return dataclasses.replace(self, rules=kept + self.grouped_expert_rules)

    def with_mtp(self) -> "McoreSpec":
        """This spec plus the rules of its multi-token-prediction layers (``mtp_layer_rules``)."""
        return dataclasses.replace(self, rules=self.rules + self.mtp_layer_rules())

    def mtp_layer_rules(self) -> tuple[WeightRule, ...]:
        """The rules of the multi-token-prediction layers (``mtp.layers.{layer}.*``, ``{layer}`` the MTP layer's HF
        index, ``MtpRules.hf_layers``): the MTP-only rules, and every decoder-layer rule again under the MTP layer's
        ``transformer_layer``, its HF names where the checkpoint stores the MTP layer's decoder layer
        (``MtpRules.layer_hf_prefix``), in the expert layout this spec already chose."""
        if self.mtp is None:
            raise ValueError("this architecture declares no multi-token-prediction rules")
        prefix = self.mtp.layer_hf_prefix

        def rehomed(name: str) -> str:
            if prefix == _L:
                return name
            if not name.startswith(_L):
                raise ValueError(f"{name}: a decoder-layer HF name outside {_L!r} cannot be moved under the MTP "
                                 f"layers' {prefix!r}")
            return prefix + name[len(_L):]

        layer = tuple(dataclasses.replace(r, mcore_name=MTP_PREFIX + "transformer_layer."
                                          + r.mcore_name[len(DECODER_PREFIX):],
                                          hf_names=tuple(rehomed(n) for n in r.hf_names))
                      for r in self.rules if r.mcore_name.startswith(DECODER_PREFIX))
        return self.mtp.rules + layer

    @property
    def uses_grouped_experts(self) -> bool:
        return any(r.grouped for r in self.rules)

    def rule_for_mcore(self, name: str) -> tuple[WeightRule, dict[str, int]]:
        hits = [(r, idx) for r in self.rules if (idx := r.match_mcore(name)) is not None]
        if len(hits) != 1:
            raise KeyError(f"Megatron parameter {name!r} matches {len(hits)} mapping rules (need exactly 1)")
        return hits[0]

    def rules_for_hf(self, name: str) -> list[tuple[WeightRule, dict[str, int]]]:
        return [(r, idx) for r in self.rules if (idx := r.match_hf(name)) is not None]

    def _fp32_rules(self) -> tuple[WeightRule, ...]:
        rules = self.rules + (self.mtp_layer_rules() if self.mtp is not None else ())
        return tuple(r for r in rules if r.keeps_fp32)

    def keeps_fp32_hf(self, name: str) -> bool:
        """Whether HF tensor ``name`` (MTP layers included) is one Megatron keeps in float32 (``keeps_fp32``)."""
        return any(r.match_hf(name) is not None for r in self._fp32_rules())

    def keeps_fp32_mcore(self, name: str) -> bool:
        """Whether Megatron tensor ``name`` (any layer index, MTP layers included) is kept in float32."""
        return any(r.match_mcore(name) is not None for r in self._fp32_rules())


@dataclass(frozen=True)
class MtpRules:
    """The multi-token-prediction part of a spec: how the checkpoint stores the MTP layers and what they are built as.

    Two layouts exist. DeepSeek-V3 / GLM-4.5 store MTP layer ``i`` as one more decoder layer,
    ``model.layers.{num_hidden_layers + i}.*``, holding its norms, projection and head norm beside the decoder layer
    (and copies of the embedding and head). Qwen3-Next / Qwen3.5 store one head under ``mtp.``: ``fc``,
    ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm`` around the decoder layer ``mtp.layers.{i}.*``.

    ``rules``: the MTP-only parameters (norms, projection, head norm), ``{layer}`` being the MTP layer's HF index
    (``hf_layers``). ``layer_hf_prefix``: where the checkpoint stores an MTP layer's decoder layer; the spec's
    decoder-layer rules are re-rooted there (``McoreSpec.mtp_layer_rules``). ``first_hf_layer``: the HF index of MTP
    layer 0 (None: ``num_hidden_layers``, right after the decoder). ``hf_prefix``: every checkpoint tensor under it
    belongs to the MTP head (dropped with a warning when the model is built without MTP layers); None: the tensors
    the rules name in the MTP layers' indices. ``shared``: HF tensors that the checkpoint stores as copies of
    main-model tensors (``(copy pattern, source HF name)``): Megatron's MTP shares the embedding and output layer
    with the main model, so loading checks that each copy equals its source bitwise, and export writes the source
    again under the copy's name.

    ``count_fields``: the HF config fields giving the number of MTP layers (the first one present), else
    ``default_count``. ``max_layers``: the most the layout can express (``max_layers_reason`` says why).
    ``refused_fields``: ``(HF config field, reason)`` pairs: a config that sets the field cannot build its MTP layers.
    ``decoder_layer_like``: the main decoder layer whose kind (dense or MoE MLP) an MTP layer's full-attention decoder
    layer has; None: the last one (Megatron's own choice).
    """

    rules: tuple[WeightRule, ...]
    shared: tuple[tuple[str, str], ...] = ()
    layer_hf_prefix: str = "model.layers.{layer}."
    first_hf_layer: int | None = None
    hf_prefix: str | None = None
    count_fields: tuple[str, ...] = ("num_nextn_predict_layers",)
    default_count: int = 0
    max_layers: int | None = None
    max_layers_reason: str = ""
    refused_fields: tuple[tuple[str, str], ...] = ()
    decoder_layer_like: int | None = None

    def __post_init__(self) -> None:
        if not self.count_fields:
            raise ValueError("MtpRules.count_fields names at least one HF config field")
        if self.max_layers is not None and not self.max_layers_reason:
            raise ValueError("MtpRules.max_layers needs max_layers_reason (what the refusal says)")

    def shared_names(self, layer: int) -> list[tuple[str, str]]:
        return [(copy.format(layer=layer), source) for copy, source in self.shared]

    def count_field(self, hf_config: Any) -> tuple[str, int]:
        """(the config field that gives the number of MTP layers, that number): the first of ``count_fields``
        present, else the first one with ``default_count``."""
        for name in self.count_fields:
            value = getattr(hf_config, name, None)
            if value is not None:
                return name, int(value)
        return self.count_fields[0], self.default_count

    def count(self, hf_config: Any) -> int:
        """The number of MTP layers the HF config declares."""
        return self.count_field(hf_config)[1]

    def hf_layers(self, num_hidden_layers: int, count: int) -> range:
        """HF indices of the ``count`` MTP layers of a model with ``num_hidden_layers`` decoder layers."""
        first = num_hidden_layers if self.first_hf_layer is None else self.first_hf_layer
        return range(first, first + count)

    def refusal(self, hf_config: Any) -> str | None:
        """Why this config's MTP layers cannot be built (None: they can)."""
        for name, reason in self.refused_fields:
            if getattr(hf_config, name, None):
                return f"{name}={getattr(hf_config, name)!r}: {reason}"
        name, count = self.count_field(hf_config)
        if self.max_layers is not None and count > self.max_layers:
            return f"{name}={count} (at most {self.max_layers}): {self.max_layers_reason}"
        return None


# ---- Rule sets shared by the spec files (compose them with tuple concatenation). ----------------------

_L = "model.layers.{layer}."
_M = "decoder.layers.{layer}."
DECODER_PREFIX = _M
MTP_PREFIX = "mtp.layers.{layer}."

CAUSAL_LM_EMBEDDING_RULES = (
    WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), parallel="vocab"),
    WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    WeightRule("output_layer.weight", ("lm_head.weight",), parallel="vocab",
               tied_hf_name="model.embed_tokens.weight"),
)
# Critics (``...ForTokenClassification``): the 1-output score head, replicated.
VALUE_HEAD_RULES = (
    WeightRule("value_head.weight", ("score.weight",)),
    WeightRule("value_head.bias", ("score.bias",)),
)
EMBEDDING_RULES = CAUSAL_LM_EMBEDDING_RULES + VALUE_HEAD_RULES


def without_value_head(rules: tuple[WeightRule, ...]) -> tuple[WeightRule, ...]:
    """``rules`` less the critic's value head (a VLM, or a text model transformers has no critic class for)."""
    return tuple(r for r in rules if not r.mcore_name.startswith("value_head."))

ATTENTION_RULES = (
    WeightRule(_M + "input_layernorm.weight", (_L + "input_layernorm.weight",)),
    WeightRule(_M + "self_attention.linear_qkv.weight",
               (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
               transform="qkv", parallel="column"),
    WeightRule(_M + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), parallel="row"),
    WeightRule(_M + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",)),
)

QKV_BIAS_RULES = (
    WeightRule(_M + "self_attention.linear_qkv.bias",
               (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"),
               transform="qkv", parallel="column"),
)

QK_NORM_RULES = (
    WeightRule(_M + "self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",)),
    WeightRule(_M + "self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",)),
)


def gated_mlp_rules(hf_prefix: str, mcore_prefix: str, *, parallel: str = "column",
                    gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> tuple[WeightRule, ...]:
    """fc1 = [gate; up], fc2 = down. ``parallel='expert'`` for routed experts (whole tensors per expert)."""
    row = "expert" if parallel == "expert" else "row"
    return (
        WeightRule(mcore_prefix + "linear_fc1.weight", (hf_prefix + f"{gate}.weight", hf_prefix + f"{up}.weight"),
                   transform="gate_up", parallel=parallel),
        WeightRule(mcore_prefix + "linear_fc2.weight", (hf_prefix + f"{down}.weight",), parallel=row),
    )


DENSE_MLP_RULES = gated_mlp_rules(_L + "mlp.", _M + "mlp.")

DENSE_RULES = EMBEDDING_RULES + ATTENTION_RULES + DENSE_MLP_RULES


def grouped_expert_rules(hf_moe: str = "mlp.", router: str | None = None) -> tuple[WeightRule, ...]:
    """``experts.gate_up_proj`` [E, 2I, D] (rows: gate then up, i.e. Megatron's fc1) and ``experts.down_proj``
    [E, D, I]: the layout transformers 5 holds in memory and some checkpoints store. ``router``: the router's
    HF module path in that layout when it differs from the per-expert checkpoints' (Mixtral)."""
    experts = _M + "mlp.experts.local_experts.{expert}."
    routers = (WeightRule(_M + "mlp.router.weight", (_L + router + ".weight",)),) if router else ()
    return routers + (
        WeightRule(experts + "linear_fc1.weight", (_L + hf_moe + "experts.gate_up_proj",), parallel="expert",
                   grouped=True),
        WeightRule(experts + "linear_fc2.weight", (_L + hf_moe + "experts.down_proj",), parallel="expert",
                   grouped=True),
    )


def moe_rules(hf_moe: str = "mlp.", *, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
              router: str = "gate") -> tuple[WeightRule, ...]:
    """Router + per-expert rules for ``model.layers.{layer}.<hf_moe>experts.{expert}.*`` checkpoints."""
    return (
        WeightRule(_M + "mlp.router.weight", (_L + hf_moe + f"{router}.weight",)),
        *gated_mlp_rules(_L + hf_moe + "experts.{expert}.", _M + "mlp.experts.local_experts.{expert}.",
                         parallel="expert", gate=gate, up=up, down=down),
    )


# Qwen's one shared expert per MoE layer (``mlp.shared_expert``) with its sigmoid gate (``mlp.shared_expert_gate``).
QWEN_SHARED_EXPERT_RULES = (
    *gated_mlp_rules(_L + "mlp.shared_expert.", _M + "mlp.shared_experts."),
    WeightRule(_M + "mlp.shared_experts.gate_weight", (_L + "mlp.shared_expert_gate.weight",)),
)


# Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv projections with their norms. The kv
# down projection carries the decoupled RoPE key slice at its end in both layouts; Megatron's MLA
# de-interleaves the RoPE dims exactly like HF's ``rope_interleave=True``. With the local (non-TE) linear
# layers actorcore builds, the down projections are column-parallel too (their outputs are gathered before
# the norms); TE's MLA would duplicate them instead.
MLA_ATTENTION_RULES = (
    WeightRule(_M + "input_layernorm.weight", (_L + "input_layernorm.weight",)),
    WeightRule(_M + "self_attention.linear_q_down_proj.weight", (_L + "self_attn.q_a_proj.weight",),
               parallel="column"),
    WeightRule(_M + "self_attention.q_layernorm.weight", (_L + "self_attn.q_a_layernorm.weight",)),
    WeightRule(_M + "self_attention.linear_q_up_proj.weight", (_L + "self_attn.q_b_proj.weight",), parallel="column"),
    WeightRule(_M + "self_attention.linear_kv_down_proj.weight", (_L + "self_attn.kv_a_proj_with_mqa.weight",),
               parallel="column"),
    WeightRule(_M + "self_attention.kv_layernorm.weight", (_L + "self_attn.kv_a_layernorm.weight",)),
    WeightRule(_M + "self_attention.linear_kv_up_proj.weight", (_L + "self_attn.kv_b_proj.weight",),
               parallel="column"),
    WeightRule(_M + "self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), parallel="row"),
    WeightRule(_M + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",)),
)

# Sigmoid router with a per-expert score-correction bias (used for choosing experts, not for weighting). Megatron's
# router keeps it in float32; the releases (DeepSeek-V3, Kimi-K2.5) and transformers store it in float32.
EXPERT_BIAS_RULES = (
    WeightRule(_M + "mlp.router.expert_bias", (_L + "mlp.gate.e_score_correction_bias",), keeps_fp32=True),
)

# DeepSeek's shared experts (``mlp.shared_experts``: one gated MLP of their combined width, no gate of their own).
DEEPSEEK_SHARED_EXPERTS_RULES = gated_mlp_rules(_L + "mlp.shared_experts.", _M + "mlp.shared_experts.")


# Vision-language models: the Megatron route runs the HF vision tower as it is (``actorcore.mcore.build.vlm``), as the
# submodule ``vision_tower`` of the first pipeline stage's model; its parameters keep their HF names under it.
VISION_TOWER = "vision_tower"


def with_hf_prefix(rules: tuple[WeightRule, ...], prefix: str, replacement: str) -> tuple[WeightRule, ...]:
    """``rules`` with every HF name (the tied alias too) that starts with ``prefix`` starting with ``replacement``
    instead, e.g. a VLM whose checkpoint stores its language model under ``model.language_model.``."""
    def rename(name: str | None) -> str | None:
        return replacement + name[len(prefix):] if name is not None and name.startswith(prefix) else name

    return tuple(dataclasses.replace(r, hf_names=tuple(rename(n) for n in r.hf_names),
                                     tied_hf_name=rename(r.tied_hf_name)) for r in rules)


def vision_tower_rules(hf_prefix: str, block_params: tuple[str, ...], other_params: tuple[str, ...],
                       blocks: str = "blocks") -> tuple[WeightRule, ...]:
    """Replicated rules ``vision_tower.<name>`` <-> ``<hf_prefix><name>`` for the tower's per-block parameters
    (``<blocks>.{layer}.<param>``) and its other parameters (patch embedding, merger)."""
    names = tuple(f"{blocks}.{{layer}}.{p}" for p in block_params) + tuple(other_params)
    return tuple(WeightRule(f"{VISION_TOWER}.{n}", (hf_prefix + n,)) for n in names)
# DeepSeek-V3's multi-token-prediction layer (GLM-4.5 / 4.6 store theirs the same way): h' = eh_proj(cat(enorm(emb(t+1)), hnorm(h))) -> decoder layer ->
# shared_head.norm -> the shared output head. The release also stores the shared embedding and head in the layer.
DEEPSEEK_MTP_RULES = MtpRules(
    rules=(
        WeightRule(MTP_PREFIX + "enorm.weight", (_L + "enorm.weight",)),
        WeightRule(MTP_PREFIX + "hnorm.weight", (_L + "hnorm.weight",)),
        WeightRule(MTP_PREFIX + "eh_proj.weight", (_L + "eh_proj.weight",), parallel="column"),
        WeightRule(MTP_PREFIX + "final_layernorm.weight", (_L + "shared_head.norm.weight",)),
    ),
    shared=((_L + "embed_tokens.weight", "model.embed_tokens.weight"),
            (_L + "shared_head.head.weight", "lm_head.weight")),
)


# ---- Hybrid Gated DeltaNet / gated attention (Qwen3-Next, Qwen3.5): see mcore/build/linear_attention.py. ------------

# Qwen3-Next / Qwen3.5's multi-token-prediction head, as vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` load and run
# it: h' = fc(cat(pre_fc_norm_embedding(emb(t+1)), pre_fc_norm_hidden(h))) -> the decoder layer mtp.layers.{i} (full
# attention; its MLP of the kind of main layer i) -> norm -> the main model's head, the norms zero-centred as the
# model's. Megatron's MTP concatenates in the same order ([embedding, hidden] before eh_proj): fc is eh_proj as stored.
QWEN_MTP_RULES = MtpRules(
    rules=(
        WeightRule(MTP_PREFIX + "enorm.weight", ("mtp.pre_fc_norm_embedding.weight",)),
        WeightRule(MTP_PREFIX + "hnorm.weight", ("mtp.pre_fc_norm_hidden.weight",)),
        WeightRule(MTP_PREFIX + "eh_proj.weight", ("mtp.fc.weight",), parallel="column"),
        WeightRule(MTP_PREFIX + "final_layernorm.weight", ("mtp.norm.weight",)),
    ),
    layer_hf_prefix="mtp.layers.{layer}.", first_hf_layer=0, hf_prefix="mtp.",
    count_fields=("mtp_num_hidden_layers",), default_count=1, max_layers=1,
    max_layers_reason="the checkpoint holds one fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm for all its "
                      "mtp.layers.{i} (vLLM runs layer i at draft step i with the same ones), while each of Megatron's "
                      "MTP depths has its own enorm / hnorm / eh_proj / final_layernorm, trained apart; build with "
                      "mtp=False, or from a config with one MTP layer (as the releases have)",
    refused_fields=(("mtp_use_dedicated_embeddings", "the MTP head has an embedding of its own, and Megatron's MTP "
                     "always uses the main model's; build with mtp=False"),),
    decoder_layer_like=0,
)


# Full-attention layers: q_proj yields the query and the sigmoid output gate (Megatron's attention_output_gate);
# q/k norms. The norms of these families are zero-centred (stored weight w scales by 1 + w): same tensors.
GATED_ATTENTION_RULES = tuple(
    dataclasses.replace(rule, transform="gated_qkv") if rule.transform == "qkv" else rule for rule in ATTENTION_RULES
) + QK_NORM_RULES

_GDN = _M + "self_attention."
_HF_GDN = _L + "linear_attn."
_QKV_SECTIONS = ("linear_key", "linear_key", "linear_value")

# Linear-attention layers, the parts both layouts share: the depthwise conv over [q; k; v] channels (split over TP
# by heads within each block), the per-value-head decay (A_log, dt_bias), the gated norm over one value head
# (replicated), the row-parallel output projection.
_GDN_COMMON_RULES = (
    WeightRule(_GDN + "conv1d.weight", (_HF_GDN + "conv1d.weight",), parallel="column", sections=_QKV_SECTIONS),
    WeightRule(_GDN + "A_log", (_HF_GDN + "A_log",), parallel="column"),
    WeightRule(_GDN + "dt_bias", (_HF_GDN + "dt_bias",), parallel="column"),
    WeightRule(_GDN + "norm.weight", (_HF_GDN + "norm.weight",)),
    WeightRule(_GDN + "out_proj.weight", (_HF_GDN + "out_proj.weight",), parallel="row"),
)

# Qwen3.5: separate projections; in_proj_qkv is [q; k; v] (split by blocks), z / b / a are per value head.
GDN_SEPARATE_RULES = _GDN_COMMON_RULES + (
    WeightRule(_GDN + "in_proj_qkv.weight", (_HF_GDN + "in_proj_qkv.weight",), parallel="column",
               sections=_QKV_SECTIONS),
    WeightRule(_GDN + "in_proj_z.weight", (_HF_GDN + "in_proj_z.weight",), parallel="column"),
    WeightRule(_GDN + "in_proj_b.weight", (_HF_GDN + "in_proj_b.weight",), parallel="column"),
    WeightRule(_GDN + "in_proj_a.weight", (_HF_GDN + "in_proj_a.weight",), parallel="column"),
)

# Qwen3-Next: fused projections grouped per key head ([q_h, k_h, v and z of its value heads]; [b, a] of them), so
# a contiguous row split is a split by key heads.
GDN_GROUPED_RULES = _GDN_COMMON_RULES + (
    WeightRule(_GDN + "in_proj_qkvz.weight", (_HF_GDN + "in_proj_qkvz.weight",), parallel="column"),
    WeightRule(_GDN + "in_proj_ba.weight", (_HF_GDN + "in_proj_ba.weight",), parallel="column"),
)
# gpt-oss: biases on every linear (q/k/v/o, router, experts), a learned sink logit per attention head (split over
# tensor-parallel ranks with the heads), and experts stacked per layer with the input dim first: ``gate_up_proj``
# ``[E, D, 2F]`` (gate and up columns interleaved) and ``down_proj`` ``[E, F, D]``, the layout its checkpoints store
# (in bf16, or as MXFP4 ``*_blocks`` / ``*_scales`` that the reader dequantises; ``mcore/convert/safetensors_reader.py``).
_GPT_OSS_EXPERTS = _M + "mlp.experts.local_experts.{expert}."
GPT_OSS_EXPERT_RULES = (
    WeightRule(_GPT_OSS_EXPERTS + "linear_fc1.weight", (_L + "mlp.experts.gate_up_proj",),
               transform="interleaved_gate_up", parallel="expert", grouped=True),
    WeightRule(_GPT_OSS_EXPERTS + "linear_fc1.bias", (_L + "mlp.experts.gate_up_proj_bias",),
               transform="interleaved_gate_up", parallel="expert", grouped=True),
    WeightRule(_GPT_OSS_EXPERTS + "linear_fc2.weight", (_L + "mlp.experts.down_proj",), transform="transpose",
               parallel="expert", grouped=True),
    WeightRule(_GPT_OSS_EXPERTS + "linear_fc2.bias", (_L + "mlp.experts.down_proj_bias",), parallel="expert",
               grouped=True),
)
GPT_OSS_RULES = EMBEDDING_RULES + ATTENTION_RULES + QKV_BIAS_RULES + (
    WeightRule(_M + "self_attention.linear_proj.bias", (_L + "self_attn.o_proj.bias",)),
    WeightRule(_M + "self_attention.core_attention.softmax_offset", (_L + "self_attn.sinks",), parallel="column"),
    WeightRule(_M + "mlp.router.weight", (_L + "mlp.router.weight",)),
    WeightRule(_M + "mlp.router.bias", (_L + "mlp.router.bias",)),
) + GPT_OSS_EXPERT_RULES


# Names renamed because the two differed by one letter; the old ones still import for one release, with a warning.
_RENAMED = {"SHARED_EXPERT_RULES": "QWEN_SHARED_EXPERT_RULES", "SHARED_EXPERTS_RULES": "DEEPSEEK_SHARED_EXPERTS_RULES"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        renamed(f"actorcore.archs.megatron_rules.{name}", _RENAMED[name])
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
