from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.spec import ArchSpec

# GLM-4.5 / 4.6: partial RoPE, optional q/k norms, the first ``first_k_dense_replace`` layers dense, then
# sigmoid-scored grouped routing with a score-correction bias and shared experts (all inside the model's own
# modules). The multi-token-prediction layers are not part of the HF model.
SPEC = ArchSpec(
    model_type="glm4_moe",
    mlp_kind="moe",
    mcore=McoreSpec(refused="conversion rules for GLM-4.5 (partial RoPE with its own layout, MTP layers) are not "
                            "written"),
)
