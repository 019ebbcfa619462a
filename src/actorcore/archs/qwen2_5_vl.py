import dataclasses

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.qwen2_vl import NO_MEGATRON_ROUTE, SPEC as QWEN2_VL

# Qwen2.5-VL: windowed vision attention (inside the tower) and absolute time in video positions, which the
# rope-index function reads from the processor's per-video ``second_per_grid_ts``.
SPEC = dataclasses.replace(
    QWEN2_VL, mcore=McoreSpec(refused=NO_MEGATRON_ROUTE), model_type="qwen2_5_vl",
    vision=dataclasses.replace(QWEN2_VL.vision, rope_index_inputs=("second_per_grid_ts",)),
)
