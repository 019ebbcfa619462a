"""Tiny, odd-sized configs for every registered architecture (hidden 64, 4 heads, 2 kv heads, vocab 131,
intermediate 88, 2 layers; MoE: 4 experts, top-2). Built from configs with a fixed seed; no downloads."""

from __future__ import annotations

import copy
from typing import Any

import torch

from actorcore.hf.register import TINY_SIZES

# The sizes register_arch proves a spec on (one table, in the product), plus what a test model also needs.
COMMON: dict[str, Any] = dict(
    **{k: TINY_SIZES[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads")},
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True)

HYBRID: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=3, linear_num_key_heads=2,
    linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12, rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
)

# One entry per registered model_type: only what differs from COMMON.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=7),
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, **MOE, decoder_sparse_step=1, mlp_only_layers=[1]),
    "gemma2": dict(head_dim=16, sliding_window=5, final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                   tie_word_embeddings=True, query_pre_attn_scalar=16),
    "gemma3_text": dict(head_dim=16, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                        tie_word_embeddings=True, query_pre_attn_scalar=16, final_logit_softcapping=4.0,
                        attn_logit_softcapping=6.0),
    "phi3": dict(tie_word_embeddings=False),
    "olmo2": {},
    "apertus": dict(max_position_embeddings=8192),  # its default llama3 rope scaling needs >= 8192
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=False,
                      shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    # sinks are random parameters; sliding and full layers alternate; the SwiGLU clamp and alpha are non-default;
    # yarn RoPE (the release's kind) with every parameter away from its default
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention"], swiglu_limit=3.0, swiglu_alpha=1.5,
                    attention_bias=True, router_aux_loss_coef=0.0,
                    rope_parameters=dict(rope_type="yarn", rope_theta=5000.0, factor=4.0, beta_fast=16.0,
                                         beta_slow=2.0, truncate=False, original_max_position_embeddings=64)),
    # partial rotary 0.5, q/k norms, one dense layer then MoE with grouped routing and a shared expert
    "glm4_moe": dict(head_dim=16, moe_intermediate_size=40, n_routed_experts=4, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                     routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                     rope_parameters=dict(rope_type="default", rope_theta=5000.0, partial_rotary_factor=0.5)),
    # every multiplier away from 1.0 (a default of 1.0 would hide a missing one)
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.09, logits_scaling=4.0),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                        routed_scaling_factor=2.5, norm_topk_prob=True),
    # Hybrid Gated DeltaNet / gated full attention: linear heads and dims unlike the attention's (2 key heads
    # serving 6 value heads, key dim 8, value dim 12), a conv of width 3, partial RoPE on half the head dim.
    "qwen3_5_text": dict(head_dim=16, **HYBRID),
    "qwen3_5_moe_text": dict(head_dim=16, **HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                             shared_expert_intermediate_size=24),
    "qwen3_next": dict(head_dim=16, **HYBRID, **MOE, shared_expert_intermediate_size=24, decoder_sparse_step=1,
                       mlp_only_layers=[1]),
}


# What a feature that does not depend on the architecture (the loss-fused head, the critic head, packing
# isolation, ...) runs over: one architecture for each thing that changes what such a feature sees. Tests about
# an architecture itself (verify, the spec contract, packed vs the model's own forward) still sweep every one.
REPRESENTATIVE_ARCHS: dict[str, str] = {
    "llama": "the baseline: untied head, dense SwiGLU, full RoPE, plain attention",
    "gemma2": "head transform (final-logit softcap), tied head, attention softcap, sliding window, GeGLU",
    "granite": "head transform (logits scaling), embedding / residual / attention multipliers",
    "qwen3_moe": "MoE MLP (tokens batched per expert) beside a dense layer",
    "glm4_moe": "partial RoPE, MoE with a shared expert and grouped routing",
    "gpt_oss": "attention sinks (the segment kernel), alternating sliding / full layers",
    "deepseek_v3": "multi-head latent attention (query and key head dims unlike the value's)",
    "qwen3_5_text": "hybrid: Gated DeltaNet linear attention (packed recurrent state) beside full attention",
}


def tiny_config(model_type: str, **overrides: Any):
    """A fresh config object (never shared between models: attention settings live on it)."""
    from transformers import AutoConfig

    if model_type not in TINY_CONFIGS:
        raise KeyError(f"no tiny config for {model_type!r}; add one to actorcore.testing.tiny_configs")
    kwargs = {**COMMON, **copy.deepcopy(TINY_CONFIGS[model_type]), **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    return config


def has_critic_class(model_type: str) -> bool:
    """Whether transformers has a ``...ForTokenClassification`` (the critic) for this architecture."""
    from transformers import AutoModelForTokenClassification

    return type(tiny_config(model_type)) in AutoModelForTokenClassification._model_mapping


def build_tiny_model(model_type: str, *, task: str = "causal_lm", seed: int = 0, dtype=torch.float32,
                     attn_implementation: str = "eager", **overrides: Any):
    """Seeded random-weight model. ``task``: ``causal_lm`` or ``token_classification`` (a 1-label critic)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    if task == "causal_lm":
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    elif task == "token_classification":
        config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(config, attn_implementation=attn_implementation,
                                                            dtype=dtype)
    else:
        raise ValueError(f"task must be 'causal_lm' or 'token_classification', got {task!r}")
    return model.eval()


def checkpointed(model: Any, reentrant: bool = False) -> Any:
    """The model's own gradient checkpointing on every layer (non-reentrant unless asked), in training mode
    (transformers 5.24 renamed the method; 5.17 has only the old one)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()
