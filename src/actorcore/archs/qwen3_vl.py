import dataclasses

from actorcore.archs.megatron_rules import (DENSE_RULES, QK_NORM_RULES, McoreSpec, vision_tower_rules,
                                            with_hf_prefix, without_value_head)
from actorcore.archs.qwen2_vl import SPEC as QWEN2_VL

# The vision tower's tensors under the checkpoint's names (``model.visual.*``): a learned position table, a
# merger and one "deepstack" merger per entry of vision_config.deepstack_visual_indexes, all replicated on Megatron
# (the HF tower itself runs there).
_MERGER = ("norm.weight", "norm.bias", "linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
TOWER_RULES = vision_tower_rules(
    "model.visual.",
    block_params=("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.qkv.weight", "attn.qkv.bias",
                  "attn.proj.weight", "attn.proj.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                  "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"),
    other_params=("patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight")
    + tuple("merger." + p for p in _MERGER),
) + vision_tower_rules("model.visual.", block_params=_MERGER, other_params=(), blocks="deepstack_merger_list")

# The language model: Qwen3's (q/k norms), stored under ``model.language_model.``; no critic head (a value head
# is refused for VLMs on the Megatron route).
LANGUAGE_MODEL_RULES = with_hf_prefix(without_value_head(DENSE_RULES + QK_NORM_RULES), "model.",
                                      "model.language_model.")

# Qwen3-VL: DeepStack (features from intermediate vision blocks are added to the outputs of the first decoder
# layers at the visual positions) and one placeholder run per video frame (timestamps between frames). On
# Megatron: interleaved M-RoPE (``rope_parameters.mrope_interleaved``, actorcore's rotary module) and the
# deepstack additions in the first pipeline stage's decoder layers (``mcore/build/vlm.py``).
SPEC = dataclasses.replace(
    QWEN2_VL, model_type="qwen3_vl",
    mcore=McoreSpec(rules=LANGUAGE_MODEL_RULES + TOWER_RULES, config_overrides=dict(qk_layernorm=True)),
    vision=dataclasses.replace(QWEN2_VL.vision, deepstack=True, video_frames_in_separate_runs=True),
)
