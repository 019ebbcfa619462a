"""Exact gradients for Megatron's multi-latent attention (MLA) under tensor + sequence parallelism.

With local (non-TransformerEngine) layers, megatron-core 0.16's MLA builds the kv down projection
column-parallel, all-gathers its output over TP, and splits off the decoupled RoPE key (``k_pos_emb``),
which every TP rank then uses for its own heads. The gather's backward keeps only this rank's slice of the
gradient, so each RoPE-key column loses the other ranks' heads' part: measured on gloo at TP=2, the kv down
projection's gradient (and every one upstream of it) differs from transformers'. MLA's other branch, the
one for a projection whose output already has the full width on this rank's ``T / tp`` tokens (TE's
duplicated linear), all-gathers the RoPE key over the sequence instead, whose backward (reduce-scatter)
sums all ranks' heads. ``route_kv_down_projection_full_width`` makes the column-parallel projection
return that shape (all-gather over the width, then this rank's tokens), so MLA takes that branch; the
weights, their names and their sharding are unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable


def _full_width_own_tokens(forward: Callable, tp_group: Any, *args: Any, **kwargs: Any):
    from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                        scatter_to_sequence_parallel_region)

    out, bias = forward(*args, **kwargs)
    out = gather_from_tensor_model_parallel_region(out, group=tp_group)
    return scatter_to_sequence_parallel_region(out, group=tp_group), bias


def route_kv_down_projection_full_width(chunk: Any) -> int:
    """Patch (per instance) every MLA kv down projection of ``chunk`` under TP with sequence parallelism;
    returns how many were patched (0 when there is nothing to fix)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    config = chunk.config
    if config.tensor_model_parallel_size == 1 or not config.sequence_parallel:
        return 0
    patched = 0
    for module in chunk.modules():
        if isinstance(module, MLASelfAttention) and isinstance(module.linear_kv_down_proj, ColumnParallelLinear):
            projection = module.linear_kv_down_proj
            projection.forward = functools.partial(_full_width_own_tokens, projection.forward, projection.tp_group)
            patched += 1
    return patched
