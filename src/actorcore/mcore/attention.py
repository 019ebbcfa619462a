"""Core attention for Megatron's local layer spec that understands packed (THD) sequences.

Megatron-Core's own ``DotProductAttention`` refuses ``PackedSeqParams``; TransformerEngine's supports them
but is often not installed. This module has DotProductAttention's constructor and forward signature and
runs actorcore's varlen causal attention (flash-attn / torch varlen / per-sequence SDPA).

Under context parallelism (cp > 1) each rank holds two chunks of every sequence (``actorcore.context_split``);
the keys and values of all CP ranks are gathered once per layer and the rank's queries attend to them
causally at their global positions. ``packed_seq_params.cu_seqlens_q_padded`` is then the padded layout of
the whole batch (Megatron's convention, which its RoPE also reads).

Legend: ``T`` packed tokens, ``N`` query heads (this TP rank), ``K`` kv heads, ``H`` head dim.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from actorcore.context_split import cp_gather_order, cp_local_positions
from actorcore.kernels.varlen_attention import causal_attention_at_positions, varlen_causal_attention
from actorcore.parallel import collectives

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
        # A caller's collections.Counter: the attention kernels count the path they ran in it (tests set it).
        self.trace: Counter[str] | None = None
        self.cp_group = None
        if config.context_parallel_size > 1:
            self.cp_group = getattr(pg_collection, "cp", None)
            if self.cp_group is None:
                from megatron.core import parallel_state

                self.cp_group = parallel_state.get_context_parallel_group()
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
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if self.cp_group is not None:
            if not packed:
                raise ValueError("context parallelism in PackedCoreAttention needs packed (THD) batches: run the "
                                 "model through actorcore.mcore.forward, which splits them over the CP ranks")
            return self._context_parallel(query, key, value, packed_seq_params, dropout)
        if packed:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            out_TNH = varlen_causal_attention(query, key, value, cu, int(packed_seq_params.max_seqlen_q),
                                              scale=self.softmax_scale, sliding_window=self.sliding_window,
                                              dropout=dropout, trace=self.trace)
            return out_TNH.reshape(out_TNH.shape[0], -1)
        # [S, B, N, H]: every row is one sequence.
        seq, batch = query.shape[:2]

        def flat(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(0, 1).reshape(seq * batch, *x.shape[2:])

        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
        out = varlen_causal_attention(flat(query), flat(key), flat(value), cu, seq, scale=self.softmax_scale,
                                      sliding_window=self.sliding_window, dropout=dropout, trace=self.trace)
        return out.reshape(batch, seq, -1).transpose(0, 1).contiguous()

    def _context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any,
                          dropout: float) -> torch.Tensor:
        """This rank's query chunks ``[L, N, H]`` against every rank's keys/values, gathered in one collective."""
        order, positions, cu_local, cu = _cp_layout(params, self.cp_group, query.device)
        key_width = key.shape[-1]
        kv_gathered = collectives.gather_cp_key_values(torch.cat([key, value], dim=-1), self.cp_group)
        kv_full = kv_gathered[order]  # the padded layout of the whole batch, in order
        out_LNH = causal_attention_at_positions(query, kv_full[..., :key_width], kv_full[..., key_width:], cu_local,
                                                cu, positions, scale=self.softmax_scale,
                                                sliding_window=self.sliding_window, dropout=dropout,
                                                trace=self.trace)
        return out_LNH.reshape(out_LNH.shape[0], -1)


def _cp_layout(params: Any, cp_group: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(gather order on the device; query positions, local and global segment offsets on the CPU) of a batch's
    CP layout.

    The first layer computes them from ``cu_seqlens_q_padded`` and keeps them on the batch's ``params``, so the
    other layers neither rebuild the index tensors nor read offsets back from the GPU."""
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    cached = getattr(params, "_actorcore_cp_layout", None)
    if cached is None or cached[0] != (cp_size, cp_rank, device):
        cu = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        bounds = [int(b) for b in cu.tolist()]
        cu_cpu = torch.tensor(bounds, dtype=torch.int64)
        cached = ((cp_size, cp_rank, device), cp_gather_order(bounds, cp_size).to(device),
                  cp_local_positions(bounds, cp_size, cp_rank), cu_cpu // cp_size, cu_cpu)
        params._actorcore_cp_layout = cached
    return cached[1:]
