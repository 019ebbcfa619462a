import dataclasses

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.qwen2_vl import NO_MEGATRON_ROUTE
from actorcore.archs.qwen3_vl import SPEC as QWEN3_VL

# Qwen3-VL with a sparse MoE text decoder (layers in config.text_config.mlp_only_layers stay dense).
SPEC = dataclasses.replace(QWEN3_VL, model_type="qwen3_vl_moe", mlp_kind="moe",
                           mcore=McoreSpec(refused=NO_MEGATRON_ROUTE))
