"""Qwen3.5 image-text model (``Qwen3_5ForConditionalGeneration``, config ``qwen3_5``): Qwen3-VL's vision side
without DeepStack (M-RoPE positions from the model's ``get_rope_index``, one placeholder run per video frame) over
the Qwen3.5 hybrid decoder (Gated DeltaNet and gated full-attention layers, per ``text_config.layer_types``).
``AutoModelForCausalLM`` on this config builds the text model instead (``qwen3_5_text``)."""

import dataclasses

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.qwen2_vl import NO_MEGATRON_ROUTE
from actorcore.archs.qwen3_5_text import SPEC as QWEN3_5_TEXT
from actorcore.archs.qwen3_vl import SPEC as QWEN3_VL

SPEC = dataclasses.replace(
    QWEN3_VL, model_type="qwen3_5", linear_attention=QWEN3_5_TEXT.linear_attention,
    vision=dataclasses.replace(QWEN3_VL.vision, deepstack=False),
    mcore=McoreSpec(refused=NO_MEGATRON_ROUTE + "; its text model, qwen3_5_text, has one"),
)
