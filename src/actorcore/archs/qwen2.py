import dataclasses

from actorcore.archs.llama import SPEC as LLAMA
from actorcore.archs.megatron_rules import DENSE_RULES, QKV_BIAS_RULES, McoreSpec

# Qwen2 always has q/k/v biases (no config field says so).
SPEC = dataclasses.replace(
    LLAMA, model_type="qwen2",
    mcore=McoreSpec(rules=DENSE_RULES + QKV_BIAS_RULES, config_overrides=dict(add_qkv_bias=True)),
)
