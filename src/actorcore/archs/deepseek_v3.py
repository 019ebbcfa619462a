from actorcore.archs.spec import ArchSpec
from actorcore.archs.megatron_rules import (
    DEEPSEEK_MTP_RULES,
    DENSE_MLP_RULES,
    EMBEDDING_RULES,
    EXPERT_BIAS_RULES,
    MLA_ATTENTION_RULES,
    DEEPSEEK_SHARED_EXPERTS_RULES,
    McoreSpec,
    grouped_expert_rules,
    moe_rules,
)

# Multi-head latent attention (low-rank q and kv projections, decoupled RoPE), sigmoid-scored grouped
# routing with a score-correction bias, shared experts, the first layers dense. The multi-token-prediction
# layers (``model.layers.{num_hidden_layers + i}.*``) are not part of the HF model; the Megatron model has them
# when built with ``mtp=True``.
SPEC = ArchSpec(
    model_type="deepseek_v3",
    mlp_kind="moe",
    mcore=McoreSpec(
        rules=EMBEDDING_RULES + MLA_ATTENTION_RULES + DENSE_MLP_RULES + moe_rules() + EXPERT_BIAS_RULES
        + DEEPSEEK_SHARED_EXPERTS_RULES,
        grouped_expert_rules=grouped_expert_rules(),
        mtp=DEEPSEEK_MTP_RULES,
        # HF's DeepseekV3 always scores with a sigmoid and chooses experts with the bias (noaux_tc), and
        # always has the q/kv low-rank norms.
        config_overrides=dict(qk_layernorm=True, moe_router_score_function="sigmoid",
                              moe_router_enable_expert_bias=True),
    ),
)
