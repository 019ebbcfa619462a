"""Qwen3.5 MoE, text part (``AutoModelForCausalLM`` on a ``qwen3_5_moe`` config builds ``Qwen3_5MoeForCausalLM``,
config ``qwen3_5_moe_text``): the Qwen3.5 hybrid layers with a sparse MoE block (routed experts plus a gated
shared expert) in every layer."""

import dataclasses

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.qwen3_5_text import SPEC as QWEN3_5

SPEC = dataclasses.replace(
    QWEN3_5, model_type="qwen3_5_moe_text", mlp_kind="moe",
    mcore=McoreSpec(refused="Gated DeltaNet (linear-attention) layers, the attention output gate, the zero-centred "
                    "RMSNorm and the gated shared expert have no rules in actorcore's Megatron conversion "
                    "(megatron-core 0.16.1's own GatedDeltaNet refuses packed THD sequences, which the route always "
                    "runs); train Qwen3.5-MoE on the Hugging Face route"),
)
