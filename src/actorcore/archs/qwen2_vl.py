from actorcore.archs._vision import VisionSpec
from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.spec import ArchSpec

NO_MEGATRON_ROUTE = ("this vision-language model has no Megatron-Core route in actorcore yet (Qwen2.5-VL, Qwen3-VL "
                     "and Qwen3-VL-MoE have one: it needs weight rules for this model's vision tower; the HF route "
                     "serves it)")

# Qwen2VLForConditionalGeneration: model.visual (vision tower) + model.language_model (text decoder) + lm_head.
# Text tokens get 1-D positions, image/video tokens 3-D (t, h, w) M-RoPE positions from model.get_rope_index.
SPEC = ArchSpec(
    model_type="qwen2_vl",
    decoder="model.language_model",
    vision=VisionSpec(),
    mcore=McoreSpec(refused=NO_MEGATRON_ROUTE),
    notes="packed M-RoPE batches via actorcore.pack(..., multimodal=, model=)",
)
