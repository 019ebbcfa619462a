from actorcore.archs.spec import ArchSpec
from actorcore.archs.megatron_rules import (
    ATTENTION_RULES,
    CAUSAL_LM_EMBEDDING_RULES,
    DEEPSEEK_MTP_RULES,
    DENSE_MLP_RULES,
    EXPERT_BIAS_RULES,
    QK_NORM_RULES,
    QKV_BIAS_RULES,
    DEEPSEEK_SHARED_EXPERTS_RULES,
    McoreSpec,
    grouped_expert_rules,
    moe_rules,
)

# GLM-4.5 / 4.6: partial RoPE, optional q/k norms, the first ``first_k_dense_replace`` layers dense, then
# sigmoid-scored grouped routing with a score-correction bias and shared experts (all inside the model's own
# modules). The multi-token-prediction layers (``model.layers.{num_hidden_layers + i}.*``, stored as DeepSeek-V3
# stores them) are not part of the HF model; the Megatron model has them when built with ``mtp=True``.
# transformers' Glm4Moe rotates the first ``partial_rotary_factor`` of each head's dims in halves
# (``rotate_half``, not GLM-4's interleaved pairs): Megatron's ``rotary_percent`` layout, so the q / k rows convert
# as they are. There is no critic class (no ``Glm4MoeForTokenClassification``), so no value-head rules.
SPEC = ArchSpec(
    model_type="glm4_moe",
    mlp_kind="moe",
    mcore=McoreSpec(
        rules=CAUSAL_LM_EMBEDDING_RULES + ATTENTION_RULES + QKV_BIAS_RULES + QK_NORM_RULES + DENSE_MLP_RULES
        + moe_rules() + EXPERT_BIAS_RULES + DEEPSEEK_SHARED_EXPERTS_RULES,
        grouped_expert_rules=grouped_expert_rules(),
        mtp=DEEPSEEK_MTP_RULES,
        partial_rotary=True,
        # The q / k norms and the q / k / v biases are switched by the config; ``attention_bias`` leaves o_proj
        # unbiased here (unlike Llama's).
        config_fields=(("use_qk_norm", "qk_layernorm"), ("attention_bias", "add_qkv_bias")),
        # HF's Glm4Moe always scores with a sigmoid, chooses experts with the bias (noaux_tc), and computes the
        # router in float32 (its gate stays float32 in a bf16 model).
        config_overrides=dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                              moe_router_dtype="fp32"),
    ),
)
