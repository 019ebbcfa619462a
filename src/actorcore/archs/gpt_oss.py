from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.spec import ArchSpec

# gpt-oss: attention sinks (a learned per-head logit in every softmax denominator, passed to the attention
# interface as ``s_aux``; actorcore's packed attention applies them exactly on its per-sequence backend),
# alternating sliding-window and full layers (``layer_types``), and a mixture of experts with a clamped
# SwiGLU (run by the model's own MoE block).
SPEC = ArchSpec(
    model_type="gpt_oss",
    mlp_kind="moe",
    mcore=McoreSpec(refused="conversion rules for gpt-oss (attention sinks, clamped SwiGLU experts with biases, "
                            "MXFP4 checkpoints) are not written"),
)
