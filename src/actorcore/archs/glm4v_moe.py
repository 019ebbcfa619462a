import dataclasses

from actorcore.archs.glm4v import SPEC as GLM4V
from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.qwen2_vl import NO_MEGATRON_ROUTE

# GLM-4.5V: GLM-4V with a sparse MoE text decoder (the first config.text_config.first_k_dense_replace layers
# dense).
SPEC = dataclasses.replace(GLM4V, model_type="glm4v_moe", mlp_kind="moe", mcore=McoreSpec(refused=NO_MEGATRON_ROUTE))
