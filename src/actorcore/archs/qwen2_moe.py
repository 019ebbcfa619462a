import dataclasses

from actorcore.archs.qwen2 import SPEC as QWEN2
from actorcore.archs.megatron_rules import QWEN_SHARED_EXPERT_RULES, grouped_expert_rules, moe_rules

# Routed experts plus one shared expert scaled by a sigmoid gate; q/k/v biases as in Qwen2.
SPEC = dataclasses.replace(
    QWEN2, model_type="qwen2_moe", mlp_kind="moe",
    mcore=dataclasses.replace(
        QWEN2.mcore, rules=QWEN2.mcore.rules + moe_rules() + QWEN_SHARED_EXPERT_RULES,
        grouped_expert_rules=grouped_expert_rules(),
        config_overrides={**QWEN2.mcore.config_overrides, "moe_shared_expert_gate": True},
    ),
)
