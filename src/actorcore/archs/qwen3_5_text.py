"""Qwen3.5 dense, text part (``AutoModelForCausalLM`` on a ``qwen3_5`` config builds ``Qwen3_5ForCausalLM``, whose
config is ``qwen3_5_text``). Hybrid: Gated DeltaNet layers (``linear_attn``) and gated full-attention layers with
partial RoPE (``self_attn``: the module applies its output gate around the attention interface), per
``config.layer_types``."""

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.archs.spec import ArchSpec, LinearAttentionSpec

SPEC = ArchSpec(
    model_type="qwen3_5_text", mlp_kind="gated",
    linear_attention=LinearAttentionSpec(module="linear_attn", projections="separate"),
    mcore=McoreSpec(refused="Gated DeltaNet (linear-attention) layers, the attention output gate and the "
                    "zero-centred RMSNorm have no rules in actorcore's Megatron conversion (megatron-core 0.16.1's "
                    "own GatedDeltaNet refuses packed THD sequences, which the route always runs); train Qwen3.5 on "
                    "the Hugging Face route"),
)
