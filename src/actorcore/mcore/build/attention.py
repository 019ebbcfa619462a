"""Core attention for Megatron's local layer spec that understands packed (THD) sequences.

Megatron-Core's own ``DotProductAttention`` refuses ``PackedSeqParams``; TransformerEngine's supports them
but is often not installed. This module has DotProductAttention's constructor and forward signature and
runs actorcore's varlen causal attention (flash-attn / torch varlen / per-sequence SDPA).

Under context parallelism (cp > 1) each rank holds two chunks of every sequence (``actorcore.context_split``)
and its queries attend causally, at their global positions, to the keys and values of all CP ranks: gathered
once per layer (``cp_comm_type`` ``None`` or ``"all_gather"``), or passed around the CP ring one rank's block
at a time, merging partial softmaxes (``"p2p"``). ``packed_seq_params.cu_seqlens_q_padded`` is then the
padded layout of the whole batch (Megatron's convention, which its RoPE also reads).

Attention sinks (``softmax_type="learnable"``, gpt-oss): a learned logit per head, ``softmax_offset`` (this TP rank's
heads, as in Megatron's ``DotProductAttention``), joins every softmax denominator; the per-sequence kernel applies
it exactly. A layer is sliding-window when Megatron's ``is_layer_window_attention`` says so (``window_size`` with
the per-layer pattern ``window_attn_skip_freq``), the others see their whole causal prefix.

The kernel (``backend``, ``kernels.attention.backends``): ``"auto"`` by default (FA4 where measured, else
FlashAttention-2); ``use_attention_backend`` names one for every core attention of a model. Context parallelism keeps
its own kernels (FlashAttention-2's layouts, or the plain ring blocks).

Legend: ``T`` packed tokens, ``N`` query heads (this TP rank), ``K`` kv heads, ``H`` head dim.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from actorcore.context_split import cp_gather_order, cp_local_positions
from actorcore.kernels.attention import block_attention, flash_blocks
from actorcore.kernels.attention.backends import BACKENDS
from actorcore.kernels.trace import add
from actorcore.kernels.attention.varlen import (VarlenCall, causal_attention_at_positions, prefix_plan,
                                                varlen_causal_attention)
from actorcore.parallel import collectives

try:  # megatron-core is optional; this module is only imported by mcore/build/model.py after require_megatron()
    from megatron.core.transformer.module import MegatronModule
except ImportError:  # pragma: no cover - guarded by require_megatron
    MegatronModule = torch.nn.Module  # type: ignore[misc,assignment]


CP_COMM_TYPES = (None, "all_gather", "p2p")
# The ring's plain-torch block kernel works on tiles of at most this many tokens (its fp32 scores per tile pair:
# heads x RING_TILE^2 x 4 bytes, 128 MiB at 32 heads) and skips the tiles a query tile cannot see.
RING_TILE = 1024


def uses_cp_ring(cp_comm_type: Any) -> bool:
    """Whether Megatron's ``TransformerConfig.cp_comm_type`` asks for the ring (``"p2p"``) rather than the
    all-gather (``None``, the default, or ``"all_gather"``); anything else is refused."""
    if cp_comm_type not in CP_COMM_TYPES or isinstance(cp_comm_type, list):
        raise ValueError(f"cp_comm_type={cp_comm_type!r} is not supported by actorcore's packed core attention: "
                         "use 'all_gather' (the default: one all-gather of the keys and values per layer) or "
                         "'p2p' (a ring exchange), one string for all layers")
    return cp_comm_type == "p2p"


class PackedCoreAttention(MegatronModule):
    """Causal attention within each sequence of a packed batch (or each row of an ``[S, B]`` batch)."""

    applies_rope = True  # rotates q and k by a batch's RopeRequest (the compiled layers': mcore/build/fused_rope.py)

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        # A caller's collections.Counter: the attention kernels count the path they ran in it (tests set it).
        self.trace: Counter[str] | None = None
        self.backend = "auto"  # the packed attention's kernel (use_attention_backend)
        self.cp_group = None
        self.cp_ring = False
        if config.context_parallel_size > 1:
            self.cp_ring = uses_cp_ring(config.cp_comm_type)
            self.cp_group = getattr(pg_collection, "cp", None)
            if self.cp_group is None:
                from megatron.core import parallel_state

                self.cp_group = parallel_state.get_context_parallel_group()
        # MLA passes its q/k head dim (k_channels) and v head dim (v_channels); they may differ.
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        from megatron.core.transformer.utils import is_layer_window_attention

        window = config.window_size
        if not is_layer_window_attention(window, config.window_attn_skip_freq, layer_number):
            window = None  # a full-attention layer between sliding ones
        # Megatron's window (left, 0) -> "query i sees key j iff 0 <= i - j < left + 1".
        self.sliding_window = None if window is None or window[0] < 0 else window[0] + 1
        self.tp_group = getattr(pg_collection, "tp", None)
        self.softmax_offset = None
        if config.softmax_type == "learnable":
            self._add_sinks(config)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by actorcore's packed core "
                             "attention (vanilla, learnable)")

    def _add_sinks(self, config: Any) -> None:
        """The learned sink logits of this TP rank's heads (``softmax_offset``, split over TP on dim 0)."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if self.tp_group is None:
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        heads = config.num_attention_heads // dist.get_world_size(self.tp_group)
        self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        if config.perform_initialization:
            config.init_method(self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The sink logits split over TP in distributed checkpoints (as Megatron's ``DotProductAttention``)."""
        if self.softmax_offset is None:
            return {}
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"softmax_offset": 0}, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not take an attention bias")
        dropout = self.dropout if self.training else 0.0
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if getattr(packed_seq_params, "rope", None) is not None:  # the compiled layers' RoPE (build/fused_rope.py)
            query, key = self._rotated(query, key, packed_seq_params)
        if self.cp_group is not None:
            if not packed:
                raise ValueError("context parallelism in PackedCoreAttention needs packed (THD) batches: run the "
                                 "model through actorcore.mcore.run.forward, which splits them over the CP ranks")
            return self._context_parallel(query, key, value, packed_seq_params, dropout)
        if packed:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            out_TNH = varlen_causal_attention(query, key, value, cu, int(packed_seq_params.max_seqlen_q),
                                              scale=self.softmax_scale, sliding_window=self.sliding_window,
                                              dropout=dropout, sinks=self.softmax_offset, backend=self.backend,
                                              trace=self.trace)
            return out_TNH.reshape(out_TNH.shape[0], -1)
        # [S, B, N, H]: every row is one sequence.
        seq, batch = query.shape[:2]

        def flat(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(0, 1).reshape(seq * batch, *x.shape[2:])

        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
        out = varlen_causal_attention(flat(query), flat(key), flat(value), cu, seq, scale=self.softmax_scale,
                                      sliding_window=self.sliding_window, dropout=dropout, sinks=self.softmax_offset,
                                      backend=self.backend, trace=self.trace)
        return out.reshape(batch, seq, -1).transpose(0, 1).contiguous()

    def _rotated(self, query: torch.Tensor, key: torch.Tensor, params: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by the micro-batch's per-token angles, compiled (what Megatron's attention left out)."""
        from actorcore.mcore.build.fused_ops import compiled, rotary
        from actorcore.mcore.build.fused_rope import FUSED_ROPE_KEY

        from actorcore.mcore.build.rotated_qk import lent

        cu = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        angles = params.rope_cache.angles(params.rope, cu, query.shape[0], query.dtype)
        if params.layer_plan is not None:
            params.layer_plan.count(FUSED_ROPE_KEY)
        rotated = compiled(rotary)(query, key, angles.cos, angles.sin)
        record = lent(self)  # mcore/build/rotated_qk.py: made again in backward rather than kept
        if record is not None:
            record.note_rotated(query, key, rotated, lambda q, k: compiled(rotary)(q, k, angles.cos, angles.sin))
        return rotated

    def _context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any,
                          dropout: float) -> torch.Tensor:
        """This rank's query chunks ``[L, N, H]`` against every rank's keys/values, gathered in one collective
        (or passed around the ring)."""
        key_width = key.shape[-1]
        if self.cp_ring:
            if dropout:
                raise ValueError("attention dropout is not supported with cp_comm_type='p2p' (the ring): set "
                                 "attention_dropout=0.0 or use cp_comm_type='all_gather'")
            blocks = _RingBlocks(params, self.cp_group, key_width, self.softmax_scale, self.sliding_window)
            if blocks.use_flash(query, key, value):
                add(self.trace, "varlen_attention:cp_ring_flash")
            else:
                add(self.trace, "varlen_attention:cp_ring")
            out_LNH = collectives.ring_cp_attention(query, torch.cat([key, value], dim=-1), blocks, self.cp_group)
            return out_LNH.reshape(out_LNH.shape[0], -1)
        order, positions, cu_local, cu = _cp_layout(params, self.cp_group, query.device)
        kv_gathered = collectives.gather_cp_key_values(torch.cat([key, value], dim=-1), self.cp_group)
        kv_full = kv_gathered[order]  # the padded layout of the whole batch, in order
        plan = _cp_prefix_plan(params, positions, cu_local, cu, self.sliding_window, query.device) \
            if query.is_cuda else None
        out_LNH = causal_attention_at_positions(query, kv_full[..., :key_width], kv_full[..., key_width:], cu_local,
                                                cu, positions, scale=self.softmax_scale,
                                                sliding_window=self.sliding_window, dropout=dropout, plan=plan,
                                                trace=self.trace)
        return out_LNH.reshape(out_LNH.shape[0], -1)


def use_attention_backend(modules: Any, backend: str) -> list[PackedCoreAttention]:
    """Run every ``PackedCoreAttention`` under ``modules`` (an ``McoreModel``, a module or a list of them) on
    ``backend`` (one of ``kernels.attention.backends.BACKENDS``; a call it cannot run raises with the reason);
    returns them. ``"auto"`` restores the default."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    modules = getattr(modules, "chunks", modules)
    roots = modules if isinstance(modules, (list, tuple)) else [modules]
    found = [m for root in roots for m in root.modules() if isinstance(m, PackedCoreAttention)]
    if not found:
        raise ValueError("no PackedCoreAttention under these modules: build the model with "
                         "actorcore.mcore.build_gpt_model")
    for module in found:
        module.backend = backend
    return found


@dataclass
class CpLayoutCache:
    """A batch's context-parallel layout, derived by the first attention layer and reused by the others (it
    travels on the batch's ``BatchParams``, so it lives as long as the micro-batch). Each entry is keyed by
    what it was derived under."""

    layout: tuple | None = None
    prefix_plan: tuple | None = None
    runs: tuple | None = None
    flash_calls: tuple | None = None


def _cache_of(params: Any) -> CpLayoutCache:
    """The batch's cache; a fresh one (nothing kept) for a plain ``PackedSeqParams`` of a caller's own forward."""
    cache = getattr(params, "cp_cache", None)
    return cache if isinstance(cache, CpLayoutCache) else CpLayoutCache()


def _cp_layout(params: Any, cp_group: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(gather order on the device; query positions, local and global segment offsets on the CPU) of a batch's
    CP layout.

    The first layer computes them from ``cu_seqlens_q_padded`` and keeps them in the batch's cache, so the
    other layers neither rebuild the index tensors nor read offsets back from the GPU."""
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    cache = _cache_of(params)
    if cache.layout is None or cache.layout[0] != (cp_size, cp_rank, device):
        cu = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        bounds = [int(b) for b in cu.tolist()]
        cu_cpu = torch.tensor(bounds, dtype=torch.int64)
        cache.layout = ((cp_size, cp_rank, device), cp_gather_order(bounds, cp_size).to(device),
                        cp_local_positions(bounds, cp_size, cp_rank), cu_cpu // cp_size, cu_cpu)
    return cache.layout[1:]


def _cp_prefix_plan(params: Any, positions: torch.Tensor, cu_local: torch.Tensor, cu: torch.Tensor,
                    window: int | None, device: torch.device):
    """The all-gather path's varlen layout on ``device`` (built by the first layer, kept in the batch's cache)."""
    key = (window, device)
    cache = _cache_of(params)
    if cache.prefix_plan is None or cache.prefix_plan[0] != key:
        cache.prefix_plan = (key, prefix_plan(cu_local, cu, positions, window).to(device))
    return cache.prefix_plan[1]


def _cp_runs(params: Any, cp_group: Any, max_run: int | None) -> list[block_attention.Runs]:
    """Per CP rank, the runs of consecutive positions its tokens hold in every segment (kept in the batch's
    cache), cut into tiles of ``max_run`` tokens (``None``: uncut)."""
    cp_size = dist.get_world_size(cp_group)
    cache = _cache_of(params)
    if cache.runs is None or cache.runs[0] != cp_size:
        cache.runs = (cp_size, {})
    by_tile = cache.runs[1]
    if max_run not in by_tile:
        cu = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        bounds = [int(b) for b in cu.tolist()]
        cu_local = torch.tensor(bounds, dtype=torch.int64) // cp_size
        by_tile[max_run] = [block_attention.position_runs(cu_local, cp_local_positions(bounds, cp_size, rank),
                                                          max_run) for rank in range(cp_size)]
    return by_tile[max_run]


def _cp_flash_calls(params: Any, cp_group: Any, device: torch.device) -> list[list[VarlenCall]] | None:
    """Per source CP rank, the flash calls of this rank's block against it (on ``device``; kept in the batch's
    cache), or ``None`` where the layout does not line up for them."""
    cp_rank = dist.get_rank(cp_group)
    cache = _cache_of(params)
    if cache.flash_calls is None or cache.flash_calls[0] != (cp_rank, device):
        runs = _cp_runs(params, cp_group, None)
        num_queries = sum(stop - start for segment in runs[cp_rank] for start, stop, _ in segment)
        plans = [flash_blocks.plan_flash_block(runs[cp_rank], source_runs, num_queries) for source_runs in runs]
        calls = None if any(plan is None for plan in plans) else [[c.to(device) for c in plan] for plan in plans]
        cache.flash_calls = ((cp_rank, device), calls)
    return cache.flash_calls[1]


class _RingBlocks:
    """What ``collectives.ring_cp_attention`` computes per block: this rank's queries against CP rank
    ``source``'s keys/values (concatenated on the last dim, keys first), causal at their global positions.

    Flash kernels (``flash_blocks``) where the inputs and layout allow (CUDA, 16-bit, no sliding window, equal
    key and value head dims), else the plain fp32 ``block_attention`` on tiles of ``RING_TILE`` tokens."""

    def __init__(self, params: Any, cp_group: Any, key_width: int, scale: float, window: int | None) -> None:
        self.params, self.cp_group = params, cp_group
        self.cp_rank = dist.get_rank(cp_group)
        self.key_width, self.scale, self.window = key_width, scale, window
        self.flash_calls: list[list[VarlenCall]] | None = None  # per source rank (flash), or
        self.runs: list[block_attention.Runs] | None = None  # every rank's tiled runs (plain)

    def use_flash(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Choose the kernel for this layer call (and build what it needs); True for flash."""
        if self.window is None and flash_blocks.flash_usable(query, key, value):
            self.flash_calls = _cp_flash_calls(self.params, self.cp_group, query.device)
        if self.flash_calls is None:
            self.runs = _cp_runs(self.params, self.cp_group, RING_TILE)
        return self.flash_calls is not None

    def _split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv[..., :self.key_width], kv[..., self.key_width:]

    def forward(self, q: torch.Tensor, kv: torch.Tensor, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        key, value = self._split(kv)
        if self.flash_calls is not None:
            return flash_blocks.flash_block_forward(q, key, value, self.flash_calls[source], scale=self.scale)
        return block_attention.attention_block_forward(q, key, value, self.runs[self.cp_rank], self.runs[source],
                                                       scale=self.scale, sliding_window=self.window)

    merge = staticmethod(block_attention.merge_attention_blocks)

    def backward(self, grad: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 delta: torch.Tensor, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        key, value = self._split(kv)
        if self.flash_calls is not None:
            dq, dk, dv = flash_blocks.flash_block_backward(grad, q, key, value, out, lse, self.flash_calls[source],
                                                           scale=self.scale)
        else:
            dq, dk, dv = block_attention.attention_block_backward(grad, q, key, value, lse, delta,
                                                                  self.runs[self.cp_rank], self.runs[source],
                                                                  scale=self.scale, sliding_window=self.window)
        return dq, torch.cat([dk, dv], dim=-1)
