import dataclasses

from actorcore.archs.llama import SPEC as LLAMA
from actorcore.archs.megatron_rules import DENSE_RULES, QK_NORM_RULES, McoreSpec

# Qwen3 always has per-head RMS norms on q and k.
SPEC = dataclasses.replace(
    LLAMA, model_type="qwen3",
    mcore=McoreSpec(rules=DENSE_RULES + QK_NORM_RULES, config_overrides=dict(qk_layernorm=True)),
)
