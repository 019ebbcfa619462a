import dataclasses

from actorcore.archs.llama import SPEC as LLAMA

# Phi-3 fuses gate and up into one gate_up_proj (and q/k/v into qkv_proj).
SPEC = dataclasses.replace(LLAMA, model_type="phi3", mlp_kind="fused_gated")
