"""Qwen3-Next: hybrid Gated DeltaNet / gated full-attention layers (``config.layer_types``) as Qwen3.5's, but the
DeltaNet input projections are fused and grouped per key head (``in_proj_qkvz``, ``in_proj_ba``); sparse MoE with a
gated shared expert, dense MLP in ``config.mlp_only_layers``. Plain (not M-) RoPE. The MTP head is stored as Qwen3.5's
(``mtp.*``); its layer count is ``num_nextn_predict_layers``, as vLLM reads it (or ``mtp_num_hidden_layers``), and one
where the config has neither, as vLLM's ``qwen3_next_mtp.py`` assumes."""

import dataclasses

from actorcore.archs.megatron_rules import (DENSE_MLP_RULES, EMBEDDING_RULES, GATED_ATTENTION_RULES,
                                            GDN_GROUPED_RULES, QWEN_MTP_RULES, QWEN_SHARED_EXPERT_RULES,
                                            grouped_expert_rules, moe_rules)
from actorcore.archs.qwen3_5_text import HYBRID_OVERRIDES
from actorcore.archs.qwen3_5_text import SPEC as QWEN3_5
from actorcore.archs.spec import LinearAttentionSpec

SPEC = dataclasses.replace(
    QWEN3_5, model_type="qwen3_next", mlp_kind="moe",
    linear_attention=LinearAttentionSpec(module="linear_attn", projections="grouped"),
    mcore=dataclasses.replace(
        QWEN3_5.mcore,
        rules=(EMBEDDING_RULES + GATED_ATTENTION_RULES + GDN_GROUPED_RULES + DENSE_MLP_RULES + moe_rules()
               + QWEN_SHARED_EXPERT_RULES),
        grouped_expert_rules=grouped_expert_rules(), text_mrope=False,
        config_overrides={**HYBRID_OVERRIDES, "moe_shared_expert_gate": True},
        mtp=dataclasses.replace(QWEN_MTP_RULES, count_fields=("num_nextn_predict_layers", "mtp_num_hidden_layers"))),
)
