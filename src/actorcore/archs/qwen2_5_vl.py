import dataclasses

from actorcore.archs.megatron_rules import (DENSE_RULES, QKV_BIAS_RULES, McoreSpec, vision_tower_rules,
                                            without_value_head)
from actorcore.archs.qwen2_vl import SPEC as QWEN2_VL

# The vision tower's tensors as the checkpoints store them (``visual.*``; transformers 5 holds them in memory
# as ``model.visual.*`` and writes them back under the checkpoint names). Megatron runs the HF tower itself.
TOWER_RULES = vision_tower_rules(
    "visual.",
    block_params=("norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                  "attn.proj.bias", "mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight",
                  "mlp.up_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias"),
    other_params=("patch_embed.proj.weight", "merger.ln_q.weight", "merger.mlp.0.weight", "merger.mlp.0.bias",
                  "merger.mlp.2.weight", "merger.mlp.2.bias"),
)

# Qwen2.5-VL: windowed vision attention (inside the tower) and absolute time in video positions, which the
# rope-index function reads from the processor's per-video ``second_per_grid_ts``. On Megatron: the language
# model is Qwen2's (q/k/v biases, checkpoint names ``model.layers.*``) with M-RoPE; the tower is HF's own.
# Checkpoints saved by transformers 4.52-4.57 store the in-memory names (``lm_head`` is the same).
IN_MEMORY_NAMES = (("model.", "model.language_model."), ("visual.", "model.visual."))

# No critic: the VLM has no score head (a value head is refused for VLMs on the Megatron route).
LANGUAGE_MODEL_RULES = without_value_head(DENSE_RULES + QKV_BIAS_RULES)

SPEC = dataclasses.replace(
    QWEN2_VL, model_type="qwen2_5_vl",
    mcore=McoreSpec(rules=LANGUAGE_MODEL_RULES + TOWER_RULES, config_overrides=dict(add_qkv_bias=True),
                    stored_prefixes=IN_MEMORY_NAMES),
    vision=dataclasses.replace(QWEN2_VL.vision, rope_index_inputs=("second_per_grid_ts",)),
)
