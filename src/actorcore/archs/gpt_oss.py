from actorcore.archs.megatron_rules import GPT_OSS_EXPERT_RULES, GPT_OSS_RULES, McoreSpec
from actorcore.archs.spec import ArchSpec

# gpt-oss: attention sinks (a learned per-head logit in every softmax denominator, passed to the attention
# interface as ``s_aux``; actorcore's packed attention applies them exactly on its per-sequence backend),
# alternating sliding-window and full layers (``layer_types``), and a mixture of experts with a clamped
# SwiGLU (run by the model's own MoE block).
# Megatron: biases on every linear (``add_bias_linear``), the sinks as ``softmax_type="learnable"``, the experts'
# clamped SwiGLU through Megatron's GLU (clamp, ``glu_linear_offset=1``); the checkpoints store the experts only
# stacked per layer (so the grouped rules are the only rules), in bf16 or MXFP4.
SPEC = ArchSpec(
    model_type="gpt_oss",
    mlp_kind="moe",
    mcore=McoreSpec(rules=GPT_OSS_RULES, grouped_expert_rules=GPT_OSS_EXPERT_RULES, activation="clamped_swiglu",
                    attention_sinks=True, config_overrides=dict(add_bias_linear=True),
                    mxfp4_weights=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
)
