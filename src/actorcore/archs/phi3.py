import dataclasses

from actorcore.archs.llama import SPEC as LLAMA
from actorcore.archs.megatron_rules import McoreSpec

# Phi-3 fuses gate and up into one gate_up_proj (and q/k/v into qkv_proj).
SPEC = dataclasses.replace(
    LLAMA, model_type="phi3", mlp_kind="fused_gated",
    mcore=McoreSpec(refused="conversion rules for Phi-3's fused qkv_proj / gate_up_proj and its longrope "
                            "scaling (not in Megatron-Core's RoPE) are not written"),
)
