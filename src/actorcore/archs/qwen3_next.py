"""Qwen3-Next: hybrid Gated DeltaNet / gated full-attention layers (``config.layer_types``); the DeltaNet input
projections are fused and grouped per key head (``in_proj_qkvz``, ``in_proj_ba``); sparse MoE with a gated shared
expert, dense MLP in ``config.mlp_only_layers``."""

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.spec import ArchSpec, LinearAttentionSpec

SPEC = ArchSpec(
    model_type="qwen3_next", mlp_kind="moe",
    linear_attention=LinearAttentionSpec(module="linear_attn", projections="grouped"),
    mcore=McoreSpec(refused="Gated DeltaNet (linear-attention) layers, the attention output gate, the zero-centred "
                    "RMSNorm and the gated shared expert have no rules in actorcore's Megatron conversion; train "
                    "Qwen3-Next on the Hugging Face route"),
)
