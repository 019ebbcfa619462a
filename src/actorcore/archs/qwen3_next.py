"""Qwen3-Next: hybrid Gated DeltaNet / gated full-attention layers (``config.layer_types``) as Qwen3.5's, but the
DeltaNet input projections are fused and grouped per key head (``in_proj_qkvz``, ``in_proj_ba``); sparse MoE with a
gated shared expert, dense MLP in ``config.mlp_only_layers``."""

import dataclasses

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.qwen3_5_text import SPEC as QWEN3_5
from actorcore.archs.spec import LinearAttentionSpec

SPEC = dataclasses.replace(
    QWEN3_5, model_type="qwen3_next", mlp_kind="moe",
    linear_attention=LinearAttentionSpec(module="linear_attn", projections="grouped"),
    mcore=McoreSpec(refused="Gated DeltaNet (linear-attention) layers with grouped projections, the attention output "
                    "gate, the zero-centred RMSNorm and the gated shared expert have no rules in actorcore's Megatron "
                    "conversion (megatron-core 0.16.1's own GatedDeltaNet refuses packed THD sequences, which the "
                    "route always runs), so its MTP layers stay out too; train Qwen3-Next on the Hugging Face "
                    "route"),
)
