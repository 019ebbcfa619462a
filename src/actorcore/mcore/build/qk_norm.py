"""The q/k norms of a compiled Megatron layer as one compiled region on views of the fused QKV projection.

Why: Megatron's ``SelfAttention.get_query_key_value_tensors`` splits the ``linear_qkv`` output per query group and
reshapes the query heads out of their groups, which copies q (the groups interleave q, k and v, so the heads cannot
be one view); ``q_layernorm`` then keeps that copy for its backward while v keeps the whole projection output alive.
On the Qwen3-30B-A3B shape that copy was 8.3 KB per token per layer, the largest single part of what the Megatron
layer kept beyond the HF route's (measured on the H100 with every activation kept: 78.9 against 61.2 KB per token
per layer; ``bench/layer_memory.py``), and torch's RMSNorm kernels on its 128-wide rows took 54 ms of a 1.2 s step.
Here both norms run in one compiled region (``fused_ops.qk_norms``) reading the views directly: the region keeps its
inputs, views of the projection output that is alive anyway, and its kernels are Inductor's.

Where (``qk_norm_refusal``): megatron-core's ``SelfAttention`` with q and k norms, one TP rank's whole query groups
(no all-gather of the projection), no output gate, no Transformer Engine split, inside the compiled layers.
Elsewhere Megatron's own code runs. Each fused call counts in ``FusedQkNormAttention.fused_calls``; the layer turns
that into the trace key ``FUSED_QK_NORM_KEY``.
"""

from __future__ import annotations

from typing import Any

import torch

from actorcore.mcore.build.fused_ops import compiled, qk_norms
from actorcore.mcore.build.rotated_qk import lent

try:  # megatron-core is optional; this module is only imported after require_megatron()
    from megatron.core.transformer.attention import SelfAttention
except ImportError:  # pragma: no cover - guarded by require_megatron
    SelfAttention = torch.nn.Module  # type: ignore[misc,assignment]

FUSED_QK_NORM_KEY = "mcore:fused_qk_norm"  # layer forwards whose q/k norms ran compiled on the projection's views


def qk_norm_refusal(attention: Any) -> str | None:
    """Why this attention's q/k norms stay Megatron's (None: ``FusedQkNormAttention`` fuses them)."""
    from megatron.core.transformer import attention as megatron_attention
    from megatron.core.transformer.identity_op import IdentityOp

    if type(attention) not in (SelfAttention, FusedQkNormAttention):
        return "attention other than megatron-core's SelfAttention"
    config = attention.config
    norms = (attention.q_layernorm, attention.k_layernorm)
    checks = (
        (all(n is not None and not isinstance(n, IdentityOp) for n in norms), "no q/k norms"),
        (config.num_query_groups >= attention.world_size, "query groups split over TP ranks (an all-gather)"),
        (not getattr(config, "attention_output_gate", False), "an attention output gate"),
        (megatron_attention.SplitAlongDim is None, "Transformer Engine's split"),
        (not config.test_mode, "Megatron's test mode"),
    )
    return next((what for ok, what in checks if not ok), None)


class FusedQkNormAttention(SelfAttention):
    """``SelfAttention`` whose q/k norms run compiled on views of the QKV projection (``qk_norm_refusal`` passed;
    the same modules, parameters and state dict). Made by ``use_fused_qk_norms`` on an existing attention."""

    fused_calls = 0

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states: Any = None,
                                    output_gate: bool = False, split_qkv: bool = True) -> Any:
        if output_gate or not split_qkv or key_value_states is not None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        from megatron.core.typed_torch import apply_module

        mixed_qkv, _ = apply_module(self.linear_qkv)(hidden_states)
        groups, head_dim = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        per_group = self.num_attention_heads_per_partition // groups
        # [sq, b, ng * (np/ng + 2) * hn] -> [sq, b, ng, (np/ng + 2) * hn], then q, k, v as views (Megatron's split)
        mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:-1], groups, (per_group + 2) * head_dim)
        query, key, value = torch.split(mixed_qkv, [per_group * head_dim, head_dim, head_dim], dim=3)
        sources = (query, key)
        query, key = compiled(qk_norms)(query, key, self.q_layernorm, self.k_layernorm, head_dim)
        self.fused_calls += 1
        record = lent(self)
        if record is not None:  # mcore/build/rotated_qk.py: the core attention's rotated q and k made again from these
            record.note_normed(query, key, sources, lambda q, k: compiled(qk_norms)(q, k, self.q_layernorm,
                                                                                  self.k_layernorm, head_dim))
        return query, key, value


def use_fused_qk_norms(attention: Any) -> bool:
    """Make ``attention`` a ``FusedQkNormAttention`` where ``qk_norm_refusal`` passes; whether it is one."""
    if qk_norm_refusal(attention) is not None:
        return False
    attention.__class__ = FusedQkNormAttention
    return True
