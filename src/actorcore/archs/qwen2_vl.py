from actorcore.archs._vision import VisionSpec
from actorcore.archs.spec import ArchSpec

# Qwen2VLForConditionalGeneration: model.visual (vision tower) + model.language_model (text decoder) + lm_head.
# Text tokens get 1-D positions, image/video tokens 3-D (t, h, w) M-RoPE positions from model.get_rope_index.
SPEC = ArchSpec(
    model_type="qwen2_vl",
    decoder="model.language_model",
    vision=VisionSpec(),
    notes="packed M-RoPE batches via actorcore.vlm_batch.pack_multimodal; no Megatron-Core route",
)
