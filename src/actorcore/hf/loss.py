"""``compute_loss``: a token-wise policy loss over a packed batch, the head's gradient formed in the forward.

Legend: ``T`` packed tokens, in the scored-token layout of ``compute_logprobs`` (row t is token t, scored
by the position before it).

Why: an actor update through ``compute_logprobs`` computes the lm-head logits twice (forward, and again in
backward once the per-token upstream gradients exist: 8NHV of matmul work). PPO/GRPO/DAPO losses are
sums of per-token terms, so ``linear_logprob_loss`` forms the head's gradient during the forward (6NHV;
``docs/benchmarks.md``). The decoder's backward is unchanged: ``loss.backward()`` runs it as usual.

The caller's ``token_args`` are in the scored-token layout; each row moves to the position that predicts
its token. Positions that score nothing (the last token of every sequence) get zeros and their losses
are dropped, so every sequence's first token contributes nothing, exactly where ``compute_logprobs``
returns 0.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch

from actorcore.batch import PackedBatch, next_token_labels, shift_to_predicting, to_scored_tokens
from actorcore.hf.as_forward import call_as_forward
from actorcore.hf.call import DecoderCall
from actorcore.hf.decoder import decoder_call, run_decoder
from actorcore.hf.head import check_head_options, token_loss
from actorcore.kernels.logprob import LossOutput
from actorcore.kernels.logprob.fused_loss import TokenLoss, check_loss_fn, check_token_args, masked_token_loss
from actorcore.parallel import sp_size


def compute_loss(model: Any, batch: PackedBatch, loss_fn: TokenLoss, token_args: Sequence[torch.Tensor] = (),
                 temperature: float = 1.0, entropy: bool = True, parallel: Any = None,
                 trace: Counter | None = None, check_finite: bool = False,
                 batch_invariant: bool = False) -> LossOutput:
    """``sum_t loss_fn(log_probs, entropy, *token_args)[t]`` over the scored tokens of ``batch``.

    ``loss_fn`` is token-wise (see ``linear_logprob_loss``) and gets float32 chunks of log-probs, entropies
    (None with ``entropy=False``) and the matching rows of each ``token_args`` tensor (``[T, ...]``, e.g.
    advantages, old log-probs, per-token weights). Returns the loss (``.backward()`` trains the model) and
    the detached ``[T]`` log-probs and entropies, equal to ``compute_logprobs``'s. Runs as the model's
    forward (FSDP2 / DDP hooks apply). ``batch_invariant=True``: as in ``compute_logprobs``, for the returned
    log-probs and entropies (and so each token's loss term).
    """
    temperature = check_head_options(temperature, entropy, trace, batch_invariant)
    check_loss_fn(loss_fn)
    if sp_size(parallel) > 1:
        raise ValueError(
            "compute_loss does not run under sequence parallelism (sp_size > 1) yet; use compute_logprobs "
            "(full [T] outputs on every rank) and compute the loss on its outputs"
        )
    call = decoder_call(model, batch, None, trace, check_finite=check_finite, batch_invariant=batch_invariant)
    token_args = tuple(a.to(call.batch.device) for a in check_token_args(token_args, call.batch.num_real_tokens,
                                                                          None))
    return call_as_forward(model, lambda: _loss_of(call, loss_fn, token_args, temperature, entropy))


def _loss_of(call: DecoderCall, loss_fn: TokenLoss, token_args: tuple, temperature: float,
             entropy: bool) -> LossOutput:
    hidden_TD, work = run_decoder(call), call.batch
    labels_T, valid_T = next_token_labels(work)
    out = token_loss(call.model, call.spec, hidden_TD, labels_T, masked_token_loss(loss_fn),
                     (valid_T, *(shift_to_predicting(a, valid_T) for a in token_args)),
                     temperature=temperature, entropy=entropy, trace=call.trace, batch_invariant=call.batch_invariant)
    entropy_T = None if out.entropy is None else to_scored_tokens(out.entropy, valid_T, work)
    return LossOutput(out.loss, to_scored_tokens(out.logprob, valid_T, work), entropy_T)
