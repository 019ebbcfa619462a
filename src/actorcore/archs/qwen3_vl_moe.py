import dataclasses

from actorcore.archs.qwen3_vl import SPEC as QWEN3_VL

# Qwen3-VL with a sparse MoE text decoder (layers in config.text_config.mlp_only_layers stay dense).
SPEC = dataclasses.replace(QWEN3_VL, model_type="qwen3_vl_moe", mlp_kind="moe")
