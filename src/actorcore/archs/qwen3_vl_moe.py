import dataclasses

from actorcore.archs.megatron_rules import McoreSpec, grouped_expert_rules, moe_rules, with_hf_prefix
from actorcore.archs.qwen3_vl import LANGUAGE_MODEL_RULES, SPEC as QWEN3_VL, TOWER_RULES

# Qwen3-VL with a sparse MoE text decoder (layers in config.text_config.mlp_only_layers stay dense). Its experts
# are stored grouped, as transformers 5 holds them (``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj``
# [E, D, I]): build the Megatron model with ``expert_layout="grouped"`` (``checkpoint_expert_layout`` reads it).
# The per-expert rules cover checkpoints with one tensor per expert.
_EXPERTS = with_hf_prefix(moe_rules(), "model.", "model.language_model.")
SPEC = dataclasses.replace(
    QWEN3_VL, model_type="qwen3_vl_moe", mlp_kind="moe",
    mcore=McoreSpec(rules=LANGUAGE_MODEL_RULES + _EXPERTS + TOWER_RULES,
                    grouped_expert_rules=with_hf_prefix(grouped_expert_rules(), "model.", "model.language_model."),
                    config_overrides=QWEN3_VL.mcore.config_overrides),
)
