"""The one autograd Function shared by every fast backend (and by the vocabulary-shard variant).

Shape suffixes: T tokens, D hidden, V vocab (the local shard's rows under tensor parallelism).

A backend ("engine": a stateless object of options) only has to provide two loops over its own bounded
workspace:

- ``forward_stats``: per-token partial statistics (m, s, a, zy; see ``_common``) over its vocabulary;
- ``backward``: recompute logits, form grad_logits from (lse, entropy, grad outputs) and return
  (grad_hidden, grad_weight) in the input dtypes.

This Function hands the statistics to the caller's ``reduce_stats`` (a vocabulary shard's caller merges
them over its group; kernels issue no collectives), saves only hidden, weight, labels, lse and entropy
(O(T) beyond the inputs) and calls the engine's backward with the same ``trace`` as the forward.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol

import torch

from actorcore.kernels.logprob._common import finish_stats
from actorcore.kernels.precision import autocast_disabled

Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]
# (m, s, a or None, zy) of this rank's vocabulary -> the same statistics of the whole vocabulary
ReduceStats = Callable[[Stats], Stats]


class Engine(Protocol):
    name: str

    def forward_stats(
        self,
        hidden_TD: torch.Tensor,
        weight_VD: torch.Tensor,
        labels_T: torch.Tensor,
        *,
        temperature: float,
        softcap: float | None,
        entropy: bool,
        chunk_size: int | None,
        trace: Counter[str] | None,
    ) -> Stats: ...

    def backward(
        self,
        hidden_TD: torch.Tensor,
        weight_VD: torch.Tensor,
        labels_T: torch.Tensor,
        lse_T: torch.Tensor,
        ent_T: torch.Tensor | None,
        grad_logprob_T: torch.Tensor | None,
        grad_ent_T: torch.Tensor | None,
        *,
        temperature: float,
        softcap: float | None,
        chunk_size: int | None,
        need_hidden: bool,
        need_weight: bool,
        trace: Counter[str] | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]: ...


class LinearLogprobEntropyFunction(torch.autograd.Function):
    """(hidden, weight, labels) -> (logprob_T, entropy_T or None), with recompute in backward.

    ``labels_T`` are local to this rank's vocabulary rows: a label outside [0, V_local) contributes
    nothing here (another shard owns it). ``reduce_stats`` (None: the rows are the whole vocabulary)
    turns this shard's statistics into the whole vocabulary's.
    """

    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, labels_T, engine, temperature, softcap, entropy, chunk_size,
                reduce_stats, trace):
        with autocast_disabled(hidden_TD.device):  # fp32 logits also inside a caller's autocast region
            stats = engine.forward_stats(
                hidden_TD, weight_VD, labels_T, temperature=temperature, softcap=softcap, entropy=entropy,
                chunk_size=chunk_size, trace=trace,
            )
            if reduce_stats is not None:
                stats = reduce_stats(stats)
            lse_T, logprob_T, ent_T = finish_stats(*stats)
        ctx.set_materialize_grads(False)
        ctx.engine = engine
        ctx.trace = trace
        ctx.temperature = temperature
        ctx.softcap = softcap
        ctx.chunk_size = chunk_size
        ctx.has_entropy = ent_T is not None
        if ent_T is not None:
            ctx.save_for_backward(hidden_TD, weight_VD, labels_T, lse_T, ent_T)
        else:
            ctx.save_for_backward(hidden_TD, weight_VD, labels_T, lse_T)
        return logprob_T, ent_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprob_T, grad_ent_T):
        no_grads = (None,) * 10
        saved = ctx.saved_tensors
        hidden_TD, weight_VD, labels_T, lse_T = saved[:4]
        ent_T = saved[4] if ctx.has_entropy else None
        if not ctx.has_entropy:
            grad_ent_T = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprob_T is None and grad_ent_T is None) or not (need_h or need_w):
            return no_grads
        with autocast_disabled(hidden_TD.device):  # a backward may run inside the caller's region too
            grad_h, grad_w = ctx.engine.backward(
                hidden_TD, weight_VD, labels_T, lse_T, ent_T,
                None if grad_logprob_T is None else grad_logprob_T.to(lse_T.dtype).contiguous(),
                None if grad_ent_T is None else grad_ent_T.to(lse_T.dtype).contiguous(),
                temperature=ctx.temperature, softcap=ctx.softcap, chunk_size=ctx.chunk_size,
                need_hidden=need_h, need_weight=need_w, trace=ctx.trace,
            )
        return (grad_h, grad_w) + no_grads[2:]
