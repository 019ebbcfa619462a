import dataclasses

from actorcore.archs.qwen3 import SPEC as QWEN3
from actorcore.archs.megatron_rules import grouped_expert_rules, moe_rules

# Sparse layers use Qwen3MoeSparseMoeBlock; layers listed in config.mlp_only_layers stay dense.
SPEC = dataclasses.replace(
    QWEN3, model_type="qwen3_moe", mlp_kind="moe",
    mcore=dataclasses.replace(QWEN3.mcore, rules=QWEN3.mcore.rules + moe_rules(),
                              grouped_expert_rules=grouped_expert_rules()),
)
