"""Qwen3.5 dense, text part (``AutoModelForCausalLM`` on a ``qwen3_5`` config builds ``Qwen3_5ForCausalLM``, whose
config is ``qwen3_5_text``). Hybrid: Gated DeltaNet layers (``linear_attn``) and gated full-attention layers with
partial RoPE (``self_attn``: the module applies its output gate around the attention interface), per
``config.layer_types``.

Megatron route: the linear-attention layers run actorcore's ``PackedGatedDeltaNet`` (``mcore/build/linear_attention.py``);
the full-attention layers Megatron's attention with ``attention_output_gate`` and q/k norms; every RMSNorm but the
DeltaNet's gated one is zero-centred (``1 + w``); RoPE on the first ``partial_rotary_factor`` of each head (the
config's M-RoPE sections see one text position, i.e. plain RoPE). The checkpoints' multi-token-prediction head
(``mtp.*``, ``mtp_num_hidden_layers`` layers; transformers does not build it) is Megatron's MTP when the model is built
with ``mtp=True`` (``QWEN_MTP_RULES``), and dropped on load otherwise."""

from actorcore.archs.megatron_rules import (DENSE_MLP_RULES, GATED_ATTENTION_RULES, GDN_SEPARATE_RULES,
                                            QWEN_MTP_RULES, CAUSAL_LM_EMBEDDING_RULES, McoreSpec)
from actorcore.archs.spec import ArchSpec, LinearAttentionSpec

# The TransformerConfig fields every Qwen3.5 / Qwen3-Next model fixes.
HYBRID_OVERRIDES = dict(qk_layernorm=True, attention_output_gate=True, layernorm_zero_centered_gamma=True)

SPEC = ArchSpec(
    model_type="qwen3_5_text", mlp_kind="gated",
    linear_attention=LinearAttentionSpec(module="linear_attn", projections="separate"),
    mcore=McoreSpec(rules=CAUSAL_LM_EMBEDDING_RULES + GATED_ATTENTION_RULES + GDN_SEPARATE_RULES + DENSE_MLP_RULES,
                    config_overrides=HYBRID_OVERRIDES, partial_rotary=True, text_mrope=True,
                    mtp=QWEN_MTP_RULES),
)
