"""Qwen3.5 MoE, text part (``AutoModelForCausalLM`` on a ``qwen3_5_moe`` config builds ``Qwen3_5MoeForCausalLM``,
config ``qwen3_5_moe_text``): the Qwen3.5 hybrid layers with a sparse MoE block (routed experts plus a shared expert
scaled by a sigmoid gate, Megatron's ``moe_shared_expert_gate``) in every layer."""

import dataclasses

from actorcore.archs.megatron_rules import (GATED_ATTENTION_RULES, GDN_SEPARATE_RULES, CAUSAL_LM_EMBEDDING_RULES,
                                            QWEN_MTP_RULES, QWEN_SHARED_EXPERT_RULES, grouped_expert_rules, moe_rules)
from actorcore.archs.qwen3_5_text import HYBRID_OVERRIDES
from actorcore.archs.qwen3_5_text import SPEC as QWEN3_5

SPEC = dataclasses.replace(
    QWEN3_5, model_type="qwen3_5_moe_text", mlp_kind="moe",
    mcore=dataclasses.replace(
        QWEN3_5.mcore,
        rules=(CAUSAL_LM_EMBEDDING_RULES + GATED_ATTENTION_RULES + GDN_SEPARATE_RULES + moe_rules()
               + QWEN_SHARED_EXPERT_RULES),
        grouped_expert_rules=grouped_expert_rules(),
        config_overrides={**HYBRID_OVERRIDES, "moe_shared_expert_gate": True}, mtp=QWEN_MTP_RULES),
)
