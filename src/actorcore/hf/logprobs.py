"""Public HF-route API: per-token log-probs, entropy and values on packed batches.

Legend: ``T`` packed tokens (this rank's shard under SP), ``D`` hidden.

One packed decoder pass (``hf.decoder``), then the fused head (``hf.head``), which never builds ``[T, V]``
logits. Under Ulysses sequence parallelism (``parallel`` with ``sp_size > 1``, model patched by
``patch_model``) each rank runs the decoder on its shard of the padded batch; labels come from the full batch
before sharding, so a shard's last token is scored against the next shard's first token; outputs are gathered
so every rank returns the full ``[T]``.

``trace``: pass a ``collections.Counter`` to see which paths ran (``"attention:actorcore_packed"`` per layer
call, the kernels' own keys); it is filled during the call and during its backward recomputation.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from actorcore.archs import spec_for_model
from actorcore.batch import PackedBatch, next_token_labels, shard_for_sp, to_scored_tokens, unpad
from actorcore.hf.as_forward import call_as_forward
from actorcore.hf.call import DecoderCall
from actorcore.hf.decoder import decoder_call, run_decoder
from actorcore.hf.head import check_head_options, token_logprobs
from actorcore.kernels.precision import value_head
from actorcore.outputs import LogProbOutput
from actorcore.parallel import sp_size


def gather_sp(local_T: torch.Tensor, parallel: Any) -> torch.Tensor:
    if sp_size(parallel) == 1:
        return local_T
    from actorcore.parallel.collectives import gather_sp as gather

    return gather(local_T, parallel)


def compute_logprobs(model: Any, batch: PackedBatch, temperature: float = 1.0, entropy: bool = True,
                     parallel: Any = None, trace: Counter | None = None, check_finite: bool = False,
                     batch_invariant: bool = False) -> LogProbOutput:
    """Exact per-token log-probs (and entropy) of ``batch`` under ``model``, float32 ``[T]``.

    ``log_probs[t] = log softmax(logits_{t-1} / temperature)[input_ids[t]]`` within each sequence; 0 at every
    sequence's first token. Differentiable (actor update) or under ``torch.no_grad()`` (old/ref log-probs).
    Runs as the model's forward (FSDP2 / DDP hooks apply). Nothing else is passed to the decoder: a misspelt
    keyword is a ``TypeError``, never a silently ignored option. ``check_finite=True`` raises
    ``NonFiniteError`` naming the first decoder layer whose output holds NaN or inf (a cheap check per layer).
    ``batch_invariant=True``: a sequence's outputs are bitwise the same whatever it is packed with, wherever it
    sits and whatever the pack's token count, with or without grad (``hf.features.batch_invariant``; costs a little
    speed: fixed-size row tiles). Dense text models only: MoE, hybrid and VLM models are refused.
    """
    temperature = check_head_options(temperature, entropy, trace, batch_invariant)
    call = decoder_call(model, batch, parallel, trace, check_finite=check_finite, batch_invariant=batch_invariant)
    return call_as_forward(model, lambda: _logprobs_of(call, temperature, entropy))


def logprobs_inside_forward(model: Any, batch: PackedBatch, temperature: float = 1.0, entropy: bool = True,
                            parallel: Any = None, trace: Counter | None = None,
                            check_finite: bool = False, batch_invariant: bool = False) -> LogProbOutput:
    """``compute_logprobs`` for callers already inside the model's forward (e.g. a patched forward)."""
    call = decoder_call(model, batch, parallel, trace, check_finite=check_finite, batch_invariant=batch_invariant)
    return _logprobs_of(call, temperature, entropy)


def _logprobs_of(call: DecoderCall, temperature: float, entropy: bool) -> LogProbOutput:
    hidden_TD = run_decoder(call)
    work, parallel = call.batch, call.parallel
    labels_T, valid_T = next_token_labels(work)
    if sp_size(parallel) > 1:
        labels_T = shard_for_sp(labels_T, int(parallel.sp_rank), sp_size(parallel))
    logprob_T, entropy_T = token_logprobs(call.model, call.spec, hidden_TD, labels_T, temperature=temperature,
                                          entropy=entropy, trace=call.trace, batch_invariant=call.batch_invariant)
    logprob_T = to_scored_tokens(gather_sp(logprob_T, parallel), valid_T, work)
    if entropy_T is not None:
        entropy_T = to_scored_tokens(gather_sp(entropy_T, parallel), valid_T, work)
    return LogProbOutput(log_probs=logprob_T, entropy=entropy_T)


def compute_values(model: Any, batch: PackedBatch, parallel: Any = None, trace: Counter | None = None,
                   check_finite: bool = False) -> torch.Tensor:
    """Per-token values ``[T]`` (float32) from a 1-label ``...ForTokenClassification`` critic.

    ``values[t]`` is the critic's output at token ``t`` itself (no shift), as the HF model computes it; the
    head runs in float32 (also inside a caller's ``torch.autocast`` region).
    """
    spec = spec_for_model(model)
    head = getattr(model, spec.value_head, None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ValueError(
            f"compute_values needs a critic with a 1-output '{spec.value_head}' head (e.g. "
            f"AutoModelForTokenClassification with num_labels=1); {type(model).__name__} has {head!r}"
        )
    call = decoder_call(model, batch, parallel, trace, check_finite=check_finite, spec=spec)
    return call_as_forward(model, lambda: _values_of(call))


def values_inside_forward(model: Any, batch: PackedBatch, parallel: Any = None, trace: Counter | None = None,
                          check_finite: bool = False) -> torch.Tensor:
    """``compute_values`` for callers already inside the model's forward (e.g. a patched forward)."""
    return _values_of(decoder_call(model, batch, parallel, trace, check_finite=check_finite))


def _values_of(call: DecoderCall) -> torch.Tensor:
    model = call.model
    head = getattr(model, call.spec.value_head)
    hidden_TD = run_decoder(call)
    dropout = getattr(model, "dropout", None)
    if isinstance(dropout, torch.nn.Module):
        hidden_TD = dropout(hidden_TD)

    values_T = call_as_forward(head, lambda: value_head(hidden_TD, head.weight, head.bias))
    return unpad(gather_sp(values_T, call.parallel), call.batch)
