from actorcore.archs.spec import ArchSpec
from actorcore.mcore.rules import McoreSpec

# Multi-head latent attention (low-rank q and kv projections, decoupled RoPE), sigmoid-scored grouped
# routing with a bias correction, one shared expert, the first layers dense. The config maps to
# Megatron-Core's MLATransformerConfig (see mcore/config.py); the weight conversion is refused for now.
SPEC = ArchSpec(
    model_type="deepseek_v3",
    mlp_kind="moe",
    mcore=McoreSpec(refused=(
        "weight conversion for DeepSeek-V3 is not implemented: its MLA projections (q_a/q_b, kv_a_proj_with_mqa "
        "with the decoupled rope slice, kv_b), the per-layer expert bias and the MTP layers need rules and an "
        "interleaved-RoPE permutation that actorcore does not have yet, and megatron-core 0.16.1's MLA with "
        "yarn RoPE cannot be checked against Hugging Face on these CPU machines (its local MLA core attention "
        "needs TransformerEngine for packed sequences); the config conversion (hf_to_mcore_config) works"
    )),
)
