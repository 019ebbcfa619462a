"""Core attention for Megatron's local layer spec that understands packed (THD) sequences.

Megatron-Core's own ``DotProductAttention`` refuses ``PackedSeqParams``; TransformerEngine's supports them
but is often not installed. This module has DotProductAttention's constructor and forward signature and
runs actorcore's varlen causal attention (flash-attn / torch varlen / per-sequence SDPA).

Legend: ``T`` packed tokens, ``N`` query heads (this TP rank), ``K`` kv heads, ``H`` head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from actorcore.kernels.varlen_attention import varlen_causal_attention

try:  # megatron-core is optional; this module is only imported by mcore/model.py after require_megatron()
    from megatron.core.transformer.module import MegatronModule
except ImportError:  # pragma: no cover - guarded by require_megatron
    MegatronModule = torch.nn.Module  # type: ignore[misc,assignment]


class PackedCoreAttention(MegatronModule):
    """Causal attention within each sequence of a packed batch (or each row of an ``[S, B]`` batch)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("PackedCoreAttention does not support context parallelism")
        # MLA passes its q/k head dim (k_channels) and v head dim (v_channels); they may differ.
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        window = config.window_size
        # Megatron's window (left, 0) -> "query i sees key j iff 0 <= i - j < left + 1".
        self.sliding_window = None if window is None or window[0] < 0 else window[0] + 1

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not take an attention bias")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            out_TNH = varlen_causal_attention(query, key, value, cu, int(packed_seq_params.max_seqlen_q),
                                              scale=self.softmax_scale, sliding_window=self.sliding_window,
                                              dropout=dropout)
            return out_TNH.reshape(out_TNH.shape[0], -1)
        # [S, B, N, H]: every row is one sequence.
        seq, batch = query.shape[:2]

        def flat(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(0, 1).reshape(seq * batch, *x.shape[2:])

        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
        out = varlen_causal_attention(flat(query), flat(key), flat(value), cu, seq, scale=self.softmax_scale,
                                      sliding_window=self.sliding_window, dropout=dropout)
        return out.reshape(batch, seq, -1).transpose(0, 1).contiguous()
