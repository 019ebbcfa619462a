import dataclasses

from actorcore.archs.qwen2_vl import SPEC as QWEN2_VL

# Qwen3-VL: DeepStack (features from intermediate vision blocks are added to the outputs of the first decoder
# layers at the visual positions) and one placeholder run per video frame (timestamps between frames).
SPEC = dataclasses.replace(
    QWEN2_VL, model_type="qwen3_vl",
    vision=dataclasses.replace(QWEN2_VL.vision, deepstack=True, video_frames_in_separate_runs=True),
)
