import dataclasses

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.qwen2_vl import NO_MEGATRON_ROUTE, SPEC as QWEN2_VL

# Qwen3-VL: DeepStack (features from intermediate vision blocks are added to the outputs of the first decoder
# layers at the visual positions) and one placeholder run per video frame (timestamps between frames).
SPEC = dataclasses.replace(
    QWEN2_VL, mcore=McoreSpec(refused=NO_MEGATRON_ROUTE), model_type="qwen3_vl",
    vision=dataclasses.replace(QWEN2_VL.vision, deepstack=True, video_frames_in_separate_runs=True),
)
