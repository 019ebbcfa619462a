import dataclasses

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.qwen2_vl import NO_MEGATRON_ROUTE, SPEC as QWEN2_VL

# GLM-4V: Qwen2-VL-style layout (model.visual, model.language_model), gate and up fused in one projection,
# partial rotary M-RoPE. Video frames are written with the *image* token, one run per frame (timestamps
# between frames): only mm_token_type_ids (2 = video) tells them from images.
SPEC = dataclasses.replace(
    QWEN2_VL, mcore=McoreSpec(refused=NO_MEGATRON_ROUTE), model_type="glm4v", mlp_kind="fused_gated",
    vision=dataclasses.replace(QWEN2_VL.vision, video_token_field="image_token_id",
                               video_frames_in_separate_runs=True, video_tower_grids_per_frame=True),
)
