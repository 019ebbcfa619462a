"""Qwen3.5-MoE image-text model (``Qwen3_5MoeForConditionalGeneration``, config ``qwen3_5_moe``): the Qwen3.5
image-text model with the sparse MoE hybrid decoder. ``AutoModelForCausalLM`` on this config builds the text model
instead (``qwen3_5_moe_text``)."""

import dataclasses

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.qwen2_vl import NO_MEGATRON_ROUTE
from actorcore.archs.qwen3_5 import SPEC as QWEN3_5

SPEC = dataclasses.replace(QWEN3_5, model_type="qwen3_5_moe", mlp_kind="moe",
                           mcore=McoreSpec(refused=NO_MEGATRON_ROUTE + "; its text model, qwen3_5_moe_text, has one"))
