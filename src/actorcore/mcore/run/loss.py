"""``compute_loss`` on the Megatron route: a token-wise loss evaluated inside the last stage's head, its gradient
formed during the forward.

Legend: ``T`` tokens of the prepared micro-batch (padding included), ``D`` hidden, ``V`` vocabulary.

Why: ``compute_logprobs(loss_fn=...)`` returns per-token log-probs whose upstream gradients exist only in backward,
so its vocabulary-parallel head computes the logits a second time there (8NHV of matmul work). A policy loss is a
sum of per-token terms, so ``linear_logprob_loss`` (the HF route's ``actorcore.compute_loss`` head) forms the head's
gradient while each chunk's statistics are in hand (6NHV on the Triton path). That needs a token's log-prob and
entropy over the whole vocabulary before its gradient, so the head runs where the whole output weight is: tensor
parallelism 1. The decoder and Megatron's schedule are unchanged: the loss goes to the schedule as any loss does.

Token args arrive in the scored-token layout (row t is token t); each row moves to the position that predicts its
token (``batch.shift_to_predicting``), and the losses of positions that score nothing are dropped
(``masked_token_loss``), exactly as on the HF route.

Trace keys (besides the fused kernel's own ``logprob:*`` keys and those of ``mcore/run/call_plan.py``):

    mcore:fused_loss    micro-batches whose last-stage head ran ``linear_logprob_loss``
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch

from actorcore.batch import PackedBatch, next_token_labels, shift_to_predicting, to_scored_tokens
from actorcore.context_split import CpShard
from actorcore.kernels.logprob import check_options, linear_logprob_loss
from actorcore.kernels.logprob.fused_loss import TokenLoss, check_loss_fn, check_token_args, masked_token_loss
from actorcore.kernels.trace import add
from actorcore.mcore.handle import McoreModel, require_model
from actorcore.mcore.run.forward import (_check_trainable, _gathered_outputs, _output_weight_shard,
                                         _share_from_last_stage, run_schedule)
from actorcore.outputs import LossOutput
from actorcore.parallel.context import ParallelContext

FUSED_LOSS_KEY = "mcore:fused_loss"
_INSTEAD = ("use actorcore.mcore.compute_logprobs(model, batches, loss_fn=...) instead (its vocabulary-parallel head "
            "recomputes the logits in backward)")


def compute_loss(model: McoreModel, batches: PackedBatch | Sequence[PackedBatch], loss_fn: TokenLoss,
                 token_args: Sequence = (), temperature: float = 1.0, entropy: bool = True, *,
                 trace: Counter | None = None):
    """Forward and backward of ``sum_t loss_fn(log_probs, entropy, *token_args)[t]`` over the scored tokens of each
    packed batch (one micro-batch each) through Megatron's pipeline schedule, the loss fused into the head.

    ``loss_fn`` is token-wise, as for ``actorcore.compute_loss`` (float32 chunks of log-probs, entropies (None with
    ``entropy=False``) and the matching rows of each token arg; one loss per token back). ``token_args``: for one
    batch a tuple of ``[T_real, ...]`` tensors in the scored-token layout (row t is token t, e.g. advantages, old
    log-probs); for a list of batches a list of such tuples, one per batch. Pass them on every rank.

    Gradients accumulate in the parameters as ``compute_logprobs(model, batches, loss_fn=...)`` with the summed
    token losses would leave them (Megatron divides each micro-batch's loss by the number of micro-batches).
    Returns a ``LossOutput`` per batch (one for a single batch) on every rank: ``loss``, the micro-batch's summed
    token loss as the head handed it to the schedule, before that division (float32, detached), and the detached
    float32 ``[T_real]`` ``logprob`` / ``entropy``, aligned as ``compute_logprobs``'s (0 at sequence starts).

    Refused (``ValueError``): tensor or context parallelism > 1, a critic, a model ``compute_logprobs`` would not
    train. A model built with MTP layers runs without them here (no MTP loss: ``compute_logprobs(...,
    mtp_loss_scale=...)`` runs them). ``trace``: what ran (the module docstring's key, the fused kernel's and the
    call plan's).
    """
    model = require_model(model, "compute_loss")
    single = isinstance(batches, PackedBatch)
    batch_list = [batches] if single else list(batches)
    check_loss_fn(loss_fn)
    check_options(temperature=temperature, entropy=entropy, trace=trace)
    _check_fused_loss_runs(model)
    if not batch_list:
        raise ValueError("compute_loss needs at least one packed batch")
    args_per_batch = _token_args_per_batch(token_args, batch_list, single, model.device)
    context, vocab_size, temperature = model.context, model.hf_config.vocab_size, float(temperature)

    def head(chunk: Any, hidden_TD: torch.Tensor, batch: PackedBatch, shard: CpShard | None, index: int):
        return loss_from_hidden(chunk, hidden_TD, batch, context, loss_fn, args_per_batch[index],
                                vocab_size=vocab_size, temperature=temperature, entropy=entropy, trace=trace)

    with torch.set_grad_enabled(True):
        data = run_schedule(model, batch_list, head, forward_only=False, trace=trace)
    outputs = _gathered_outputs(model, data, batch_list, entropy, 0)
    losses = _share_from_last_stage([d["loss"] for d in data] or [None] * len(batch_list), [1] * len(batch_list),
                                    model)
    results = [LossOutput(loss[0], out.log_probs, out.entropy) for loss, out in zip(losses, outputs)]
    return results[0] if single else results


def loss_from_hidden(chunk: Any, hidden_TD: torch.Tensor, batch: PackedBatch, context: ParallelContext,
                     loss_fn: TokenLoss, token_args: tuple[torch.Tensor, ...], *, vocab_size: int, temperature: float,
                     entropy: bool, trace: Counter | None) -> tuple[torch.Tensor, dict]:
    """The last stage's head: ``(loss, data)`` for the schedule, the loss summed over the scored tokens of the
    prepared ``batch`` and its gradient already formed. ``data`` holds a copy of the loss (the schedule scales the
    loss in place) and the scored-token log-probs / entropies."""
    weight, _ = _output_weight_shard(chunk, vocab_size, context)
    labels_T, valid_T = next_token_labels(batch)
    args = tuple(shift_to_predicting(a, valid_T) for a in token_args)
    out = linear_logprob_loss(hidden_TD, weight, labels_T.clamp(min=0), masked_token_loss(loss_fn),
                              token_args=(valid_T, *args), temperature=temperature, entropy=entropy, trace=trace)
    add(trace, FUSED_LOSS_KEY)
    data = {"loss": out.loss.detach().to(torch.float32, copy=True).reshape(1),
            "log_probs": to_scored_tokens(out.logprob.float(), valid_T, batch),
            "entropy": None if out.entropy is None else to_scored_tokens(out.entropy.float(), valid_T, batch)}
    return out.loss, data


def _check_fused_loss_runs(model: McoreModel) -> None:
    """Refuse what the loss-fused head cannot run, saying what to use."""
    parallel = model.parallel
    if model.value_head:
        raise ValueError("compute_loss scores tokens with the lm head, which a critic (built with value_head=True) "
                         "does not have: build the policy model without value_head")
    if parallel.tp > 1:
        raise ValueError(f"compute_loss needs the whole vocabulary on one rank, got tensor parallelism "
                         f"tp={parallel.tp}: the loss-fused head forms each token's gradient from its log-prob and "
                         "entropy, which need "
                         f"every vocabulary shard's statistics first; {_INSTEAD}")
    if parallel.cp > 1:
        raise ValueError(f"compute_loss does not run under context parallelism (cp={parallel.cp}): the token args and "
                         "losses would have to follow Megatron's load-balanced split of every sequence over the CP "
                         f"ranks, which the loss-fused head does not do; {_INSTEAD}")
    _check_trainable(model.config)


def _token_args_per_batch(token_args: Sequence, batches: list[PackedBatch], single: bool,
                          device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """One checked tuple of token args per batch, on the model's device."""
    if single:
        per_batch = [token_args]
    elif isinstance(token_args, (tuple, list)) and not token_args:
        per_batch = [()] * len(batches)
    elif not isinstance(token_args, (tuple, list)) or any(isinstance(a, torch.Tensor) for a in token_args):
        raise ValueError("for a list of batches, token_args is a list with one tuple of [T_real, ...] tensors per "
                         "batch, e.g. [(advantages_0,), (advantages_1,)]")
    elif len(token_args) != len(batches):
        raise ValueError(f"token_args has {len(token_args)} entries for {len(batches)} batches: pass one tuple of "
                         "token args per batch")
    else:
        per_batch = list(token_args)
    out = []
    for i, (args, batch) in enumerate(zip(per_batch, batches)):
        try:
            checked = check_token_args(args, batch.num_real_tokens, None)
        except ValueError as error:
            raise ValueError(str(error) if single else f"batch {i}: {error}") from None
        out.append(tuple(a.to(device) for a in checked))
    if len({len(args) for args in out}) > 1:
        raise ValueError(f"every batch needs the same number of token args (loss_fn takes them all), got "
                         f"{[len(args) for args in out]}")
    return out
