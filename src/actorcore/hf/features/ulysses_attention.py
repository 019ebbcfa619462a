"""Ulysses sequence-parallel attention, registered in transformers' ``AttentionInterface``.

Legend: ``L`` this rank's tokens, ``T`` all tokens of the (padded) packed batch, ``N`` / ``K`` query / kv
heads, ``n`` / ``k`` this rank's heads, ``H`` head dim.

transformers calls it with this rank's token shard, ``[1, heads, L, H]``. It exchanges q/k/v for all tokens
of this rank's heads, runs the same packed attention as the one-process path on the FULL batch's
``cu_seq_lens_q`` (every sequence complete, nothing across sequences), and exchanges the output back.
The SP group comes with the call: the ``ParallelContext`` passed to ``compute_logprobs`` travels down the
decoder's keyword arguments (``PARALLEL_KWARG``); nothing is looked up in a module-level map.
"""

from __future__ import annotations

from typing import Any

import torch

from actorcore.hf.call import parallel_from_kwargs
from actorcore.hf.features.attention import attend_packed, attention_sinks, packing_kwargs, record_call
from actorcore.parallel.ulysses import head_to_sequence_sharded, replicate_kv_heads, sequence_to_head_sharded
from actorcore.errors import PatchNotAppliedError  # noqa: F401 (re-exported)

ULYSSES_ATTENTION = "actorcore_ulysses"


@torch.compiler.disable  # left out of compiled graphs: collectives, host reads, counts itself in the trace
def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function: q/k/v ``[1, heads, L, H]`` -> ``([1, L, N, H], None)``."""
    record_call(kwargs, ULYSSES_ATTENTION)
    ctx = parallel_from_kwargs(kwargs)
    if ctx is None or ctx.sp_size == 1:
        raise PatchNotAppliedError(
            f"{type(module).__name__} runs Ulysses attention but the call carries no sequence-parallel context: "
            "call the model through actorcore.compute_logprobs / compute_values with parallel=ctx (a model "
            "patched for Ulysses SP cannot run a plain forward; handle.revert() restores it). If this model was "
            "never patched, it shares its config object with one that was: build each model from its own config"
        )
    cu_seqlens, max_seqlen = packing_kwargs(kwargs)
    sp, group = ctx.sp_size, ctx.sp_group
    q_LNH, k_LKH, v_LKH = (x[0].transpose(0, 1) for x in (query, key, value))
    local = q_LNH.shape[0]
    if not cu_seqlens.is_cuda and int(cu_seqlens[-1]) != local * sp:  # no device sync on the GPU path
        raise ValueError(f"cu_seq_lens_q covers {int(cu_seqlens[-1])} tokens but {sp} ranks hold {local} each; "
                         "pass the full padded batch's cu_seqlens (compute_logprobs does)")
    q_TnH = sequence_to_head_sharded(q_LNH, group, sp)
    k_TkH = sequence_to_head_sharded(replicate_kv_heads(k_LKH, sp), group, sp)
    v_TkH = sequence_to_head_sharded(replicate_kv_heads(v_LKH, sp), group, sp)
    out_TnH = attend_packed(*(x.transpose(0, 1).unsqueeze(0) for x in (q_TnH, k_TkH, v_TkH)), cu_seqlens,
                            max_seqlen, scaling=scaling, dropout=dropout, sliding_window=sliding_window,
                            softcap=softcap, sinks=_local_heads(attention_sinks(kwargs), ctx), module=module,
                            kwargs=kwargs)
    return head_to_sequence_sharded(out_TnH, group, sp).unsqueeze(0), None


def _local_heads(per_head: torch.Tensor | None, ctx: Any) -> torch.Tensor | None:
    """This rank's query heads' slice of a per-head tensor (after the all-to-all a rank holds head group
    ``sp_rank``)."""
    if per_head is None:
        return None
    n = per_head.shape[0] // ctx.sp_size
    return per_head[ctx.sp_rank * n: (ctx.sp_rank + 1) * n]
