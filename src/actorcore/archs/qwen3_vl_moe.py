import dataclasses

from actorcore.archs.megatron_rules import McoreSpec, grouped_expert_rules, with_hf_prefix
from actorcore.archs.qwen3_vl import LANGUAGE_MODEL_RULES, SPEC as QWEN3_VL, TOWER_RULES

# Qwen3-VL with a sparse MoE text decoder (layers in config.text_config.mlp_only_layers stay dense). Its
# checkpoints store the experts grouped only, as transformers 5 holds and writes them (``experts.gate_up_proj``
# [E, 2I, D], ``experts.down_proj`` [E, D, I]), so its expert rules are the grouped ones and ``build_gpt_model``
# defaults to ``expert_layout="grouped"`` for it. (The Qwen release stores them transposed, [E, D, 2I] and
# [E, I, D], which transformers transposes on load: convert such a checkpoint with transformers first.)
_EXPERTS = with_hf_prefix(grouped_expert_rules(router="mlp.gate"), "model.", "model.language_model.")
SPEC = dataclasses.replace(
    QWEN3_VL, model_type="qwen3_vl_moe", mlp_kind="moe",
    mcore=McoreSpec(rules=LANGUAGE_MODEL_RULES + _EXPERTS + TOWER_RULES,
                    config_overrides=QWEN3_VL.mcore.config_overrides),
)
