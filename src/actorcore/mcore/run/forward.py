"""Per-token log-probs, entropy and values of a Megatron model on packed (THD) batches.

Runs through Megatron's pipeline schedule (``get_forward_backward_func``), one packed batch per
micro-batch, forward-only or forward-backward. The last stage turns final hidden states into per-token
float32 log-probs/entropy with the vocabulary-parallel fused kernel (no ``[T, V]`` logits); results are
broadcast over the pipeline group so every rank returns them, aligned exactly like the HF route
(value at the scored token, 0 at each sequence's first token, padding dropped).

Context parallelism (cp > 1): every packed batch is split over the CP ranks with Megatron's load-balanced
layout (``actorcore.context_split.split_for_cp``: sequences padded to a multiple of 2*cp, rank r holding
chunks r and 2*cp-1-r); labels are taken before the split, and the per-token results of all CP ranks are
gathered back into the batch's ``[T]`` order before the loss, which every CP rank computes on the whole batch.

Multi-token prediction (a model built with ``mtp=True``, ``compute_logprobs(..., mtp_loss_scale=...)``): the
last stage also runs Megatron's MTP layers; depth ``d`` (1-based) scores token ``t + 1 + d`` from position ``t``
of the same sequence (targets stop at each sequence's end), with the same fused kernel and output weight.

Legend: ``T`` packed tokens, ``D`` hidden, ``V`` vocabulary (this TP rank's rows).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from actorcore.batch import IGNORE_INDEX, PackedBatch, next_token_labels, pad_to_multiple, to_scored_tokens, unpad
from actorcore.context_split import CpShard, split_for_cp
from actorcore.kernels.logprob import check_options
from actorcore.kernels.precision import value_head
from actorcore.kernels.trace import check_trace
from actorcore.mcore.cpu_runtime import te_absent_fixes
from actorcore.mcore.handle import McoreModel, require_model
from actorcore.outputs import LogProbOutput
from actorcore.parallel import collectives
from actorcore.parallel.context import ParallelContext
from actorcore.parallel.vocab_parallel import linear_logprob_entropy_vocab_parallel


def packed_seq_params(batch: PackedBatch | CpShard, cp_group: Any = None, *, run_mtp: bool = False,
                      layer_plan: Any = None):
    """Megatron's THD parameters for one micro-batch (our ``BatchParams``, which also carries the call's
    ``run_mtp`` and ``layer_plan``); for a CP shard, the padded layout of the whole batch (``cu_seqlens_*_padded``,
    which Megatron's RoPE and ``PackedCoreAttention`` read)."""
    from actorcore.mcore.run.batch_params import BatchParams

    cu = batch.cu_seqlens.to(torch.int32)
    padded = cu if isinstance(batch, CpShard) else None
    return BatchParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                       cu_seqlens_kv_padded=padded, max_seqlen_q=int(batch.max_seqlen),
                       max_seqlen_kv=int(batch.max_seqlen), cp_group=cp_group, run_mtp=run_mtp,
                       layer_plan=layer_plan)


def prepare_batch(batch: PackedBatch, model: McoreModel) -> PackedBatch:
    """Pad to the token multiple the layout needs (TP with sequence parallelism); move to the model device.
    Under context parallelism the split pads every sequence instead (``split_for_cp``)."""
    if batch.position_ids.dim() != 1 and model.config.mrope_section is None:
        raise ValueError("the Megatron route takes text batches with 1-D position ids (M-RoPE positions only for "
                         "a vision-language model)")
    if not batch.num_padding and model.parallel.cp == 1:
        batch = pad_to_multiple(batch, model.token_multiple)
    return batch.to(model.device)


def split_batches(batches: Sequence[PackedBatch], model: McoreModel) -> list[CpShard]:
    """This CP rank's shard of every micro-batch, all padded to one token count (pipeline stages exchange
    fixed shapes)."""
    from actorcore.context_split import cp_padded_bounds

    context = model.context
    cp, multiple = context.cp_size, model.token_multiple
    totals = [-(-cp_padded_bounds([int(x) for x in b.cu_seqlens.tolist()], cp)[-1] // multiple) * multiple
              for b in batches]
    if context.pp_size > 1:
        totals = [max(totals)] * len(totals)
    return [split_for_cp(b, cp, context.cp_rank, total=t) for b, t in zip(batches, totals)]


def _output_weight_shard(chunk: Any, vocab_size: int, context: ParallelContext) -> tuple[torch.Tensor, int]:
    """This TP rank's rows of the output weight without the vocabulary padding, and its first vocab id. The
    parameter itself where it has no padding rows: a slice of it would make backward write the head's weight
    gradient into a new zero-filled ``[V, D]`` tensor (a copy at the start of backward, where memory peaks)."""
    weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights \
        else chunk.output_layer.weight
    rows = weight.shape[0]
    start = context.tp_rank * rows
    real = max(0, min(rows, vocab_size - start))
    return (weight if real == rows else weight[:real]), start


def _hidden_TD(output: torch.Tensor) -> torch.Tensor:
    # GPTModel returns [B=1, T, D] (its output layer passes hidden states through).
    return output.reshape(-1, output.shape[-1])


def _all_tokens_on_every_tp_rank(chunk: Any, hidden_TD: torch.Tensor, context: ParallelContext) -> torch.Tensor:
    """Every token's hidden state on each TP rank, whose backward sums the ranks' partial gradients (each
    rank's vocabulary rows contribute one part). Under sequence parallelism a rank holds ``T / tp`` tokens:
    all-gathered, with a reduce-scatter backward; otherwise they are replicated: all-reduce backward."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    if chunk.config.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden_TD, tensor_parallel_output_grad=True,
                                                    group=context.tp_group)
    return copy_to_tensor_model_parallel_region(hidden_TD, group=context.tp_group)


def _merge_cp(local_L: torch.Tensor, shard: CpShard | None, context: ParallelContext) -> torch.Tensor:
    """Without CP: as it is. With CP: every CP rank's per-token results, in the batch's ``[T]`` token order."""
    if shard is None:
        return local_L
    return shard.merge(collectives.gather_cp_outputs(local_L, context.cp_group))


def logprobs_from_hidden(chunk: Any, hidden_TD: torch.Tensor, batch: PackedBatch, context: ParallelContext, *,
                         vocab_size: int, temperature: float, entropy: bool,
                         shard: CpShard | None = None) -> LogProbOutput:
    """The last stage's head: fused vocabulary-parallel log-prob/entropy, aligned to the scored token
    (``vocab_size``: the HF vocabulary, without Megatron's padding).

    With a CP ``shard``, ``hidden_TD`` holds this rank's tokens; the labels are the shard's (taken before the
    split) and the results are gathered over the CP group into the batch's order."""
    weight, start = _output_weight_shard(chunk, vocab_size, context)
    labels_T, valid_T = next_token_labels(batch)
    local_labels = labels_T if shard is None else shard.labels
    hidden_TD = _all_tokens_on_every_tp_rank(chunk, hidden_TD, context)
    logprob_T, entropy_T = linear_logprob_entropy_vocab_parallel(
        hidden_TD, weight, local_labels.clamp(min=0), vocab_start=start,
        tp_group=context.tp_group if context.tp_size > 1 else None, temperature=temperature, entropy=entropy)

    def finish(x: torch.Tensor) -> torch.Tensor:
        return to_scored_tokens(_merge_cp(x.float(), shard, context), valid_T, batch)

    return LogProbOutput(log_probs=finish(logprob_T), entropy=None if entropy_T is None else finish(entropy_T))


def mtp_labels(batch: PackedBatch, depth: int) -> torch.Tensor:
    """Labels of MTP depth ``depth`` (1-based) at each predicting position ``t``: ``input_ids[t + 1 + depth]``
    when that token is in the same real sequence, else ``IGNORE_INDEX`` (never a token of the next sequence)."""
    shift = 1 + depth
    tokens = batch.num_tokens
    labels = torch.full_like(batch.input_ids, IGNORE_INDEX)
    if shift >= tokens:
        return labels
    labels[:-shift] = batch.input_ids[shift:]
    cu = batch.cu_seqlens.long()
    ends = torch.repeat_interleave(cu[1:], cu[1:] - cu[:-1])  # each token's sequence end (exclusive)
    position = torch.arange(tokens, device=labels.device)
    crossing = (position + shift >= ends) | (position >= batch.num_real_tokens)
    return labels.masked_fill(crossing, IGNORE_INDEX)


def mtp_loss(mtp_log_probs: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Megatron's MTP loss from ``LogProbOutput.mtp_log_probs`` ``[mtp, T]``: per depth the mean negative
    log-prob over its scored tokens, averaged over the depths (``mtp_loss_scale`` multiplies it)."""
    losses = []
    for depth in range(1, mtp_log_probs.shape[0] + 1):
        scored = shift_to_scored_token_by(mtp_labels(batch, depth) != IGNORE_INDEX, 1 + depth)
        scored = unpad(scored, batch)
        losses.append(-(mtp_log_probs[depth - 1] * scored).sum() / scored.sum().clamp(min=1))
    return torch.stack(losses).mean()


def shift_to_scored_token_by(predicting_T: torch.Tensor, shift: int) -> torch.Tensor:
    """Values moved from the predicting position ``t`` to the scored token ``t + shift``; 0 before."""
    out = torch.zeros_like(predicting_T)
    if shift < predicting_T.shape[0]:
        out[shift:] = predicting_T[:-shift]
    return out


def mtp_logprobs_from_hidden(chunk: Any, mtp_hidden_TD: list[torch.Tensor], batch: PackedBatch,
                             context: ParallelContext, vocab_size: int) -> torch.Tensor:
    """Per-token log-probs of every MTP depth, ``[mtp, T]`` float32, each aligned to its scored token (0 where
    a depth scores nothing: a sequence's first ``1 + depth`` tokens). The MTP layers end in the shared head
    norm; the output weight is the main head's (Megatron shares it). Always at temperature 1: the MTP loss is
    the draft head's language-modelling loss, as in Megatron, whatever temperature the policy is scored at."""
    weight, start = _output_weight_shard(chunk, vocab_size, context)
    rows = []
    for depth, hidden_TD in enumerate(mtp_hidden_TD, start=1):
        labels_T = mtp_labels(batch, depth)
        hidden_TD = _all_tokens_on_every_tp_rank(chunk, hidden_TD, context)
        logprob_T, _ = linear_logprob_entropy_vocab_parallel(
            hidden_TD, weight, labels_T.clamp(min=0), vocab_start=start,
            tp_group=context.tp_group if context.tp_size > 1 else None, temperature=1.0, entropy=False)
        kept = torch.where(labels_T != IGNORE_INDEX, logprob_T.float(), torch.zeros((), device=logprob_T.device))
        rows.append(unpad(shift_to_scored_token_by(kept, 1 + depth), batch))
    return torch.stack(rows)


def values_from_hidden(chunk: Any, hidden_TD: torch.Tensor, batch: PackedBatch, context: ParallelContext,
                       shard: CpShard | None = None) -> torch.Tensor:
    """Critic head at each token itself, in float32 with autocast off in forward and backward (the HF critic's
    ``kernels.precision.value_head``)."""
    head = chunk.value_head
    hidden_TD = _all_tokens_on_every_tp_rank(chunk, hidden_TD, context)
    return unpad(_merge_cp(value_head(hidden_TD, head.weight, head.bias), shard, context), batch)


def _forward_step(model: McoreModel, batches: list[PackedBatch], shards: list[CpShard] | None, head: Callable,
                  run_mtp: bool, layer_plan: Any, data_iterator: Any, chunk: Any, return_schedule_plan: bool = False):
    """One micro-batch's forward. ``return_schedule_plan``: Megatron's combined 1F1B schedule (a model built with
    ``overlap_moe_expert_parallel_comm=True``) asks for the chunk's schedule plan instead of its output; the plan
    runs the same modules layer by layer (attention, dispatch, experts, combine as separate nodes) and its post-
    processing returns the same hidden states, in float32."""
    index = next(data_iterator)
    batch = batches[index]
    shard = None if shards is None else shards[index]
    local = batch if shard is None else shard
    params = packed_seq_params(local, model.context.cp_group, run_mtp=run_mtp, layer_plan=layer_plan)
    if return_schedule_plan:
        output = chunk.build_schedule_plan(local.input_ids.unsqueeze(0), local.position_ids.unsqueeze(0), None,
                                           packed_seq_params=params)
    elif model.vlm_config is not None:  # the vision tower's features in the decoder input
        from actorcore.mcore.run.vlm_inputs import vlm_chunk_forward

        output = vlm_chunk_forward(chunk, local, params, model.vlm_config)
    else:
        output = chunk(local.input_ids.unsqueeze(0), local.position_ids.unsqueeze(0), None, packed_seq_params=params)

    def loss_func(output_tensor: torch.Tensor):
        if return_schedule_plan:  # the plan's post-processing hands float32 over: back to the model dtype (exact)
            output_tensor = output_tensor.to(chunk.config.params_dtype)
        return head(chunk, _hidden_TD(output_tensor), batch, shard, index)

    return output, loss_func


def run_schedule(model: McoreModel, batches: Sequence[PackedBatch], head: Callable, *, forward_only: bool,
                 run_mtp: bool = False, trace: Counter | None = None) -> list[Any]:
    """One micro-batch per packed batch; ``head(chunk, hidden_TD, batch, shard, index) -> (loss, data)`` on the last
    stage (``batch``: the prepared micro-batch, ``index`` its place in ``batches``; ``shard``: this rank's ``CpShard``
    of the batch, None without CP). ``run_mtp``: the MTP layers run in this call's forwards. Returns the ``data`` of
    every micro-batch on the last pipeline stage (empty elsewhere). The call's ``LayerPlan``
    (``mcore/run/call_plan.py``: each layer's recompute mode) goes to every layer with the micro-batch; what ran is
    counted in ``trace`` and checked after the call."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from actorcore.mcore.run.call_plan import check_plan_ran, counting_experts, plan_call

    chunks, context = model.chunks, model.context
    batches = [prepare_batch(b, model) for b in batches]
    shards = split_batches(batches, model) if context.cp_size > 1 else None
    for chunk in chunks:
        chunk.train(not forward_only)
    plan = plan_call(model, batches if shards is None else shards, forward_only=forward_only, trace=trace)
    step = functools.partial(_forward_step, model, batches, shards, head, run_mtp, plan)
    iterators = [iter(range(len(batches))) for _ in chunks]
    max_tokens = max(b.num_tokens for b in (batches if shards is None else shards))
    if context.pp_size > 1 and shards is None and any(b.num_tokens != max_tokens for b in batches):
        raise ValueError("with pipeline parallelism every micro-batch must have the same token count: pad the "
                         "packed batches to a common length (pad_to_multiple) first")
    with te_absent_fixes(), counting_experts(model, plan):
        data = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches), seq_length=max_tokens,
            micro_batch_size=1, forward_only=forward_only)
    check_plan_ran(model, plan, len(batches))
    return data


def _share_from_last_stage(tensors: list[torch.Tensor | None], shapes: list[int],
                           model: McoreModel) -> list[torch.Tensor]:
    """Every rank gets the last stage's per-micro-batch ``[T]`` float32 tensors.

    The receive buffers live on the model's device: NCCL has no CPU tensors (a CPU buffer fails with "No
    backend type associated with device type cpu")."""
    out = []
    context = model.context
    last = context.pp_size - 1
    device = model.device
    for tensor, length in zip(tensors, shapes):
        buffer = (tensor.detach().clone() if tensor is not None
                  else torch.empty(length, dtype=torch.float32, device=device))
        out.append(collectives.broadcast_tensor(buffer, last, context.pp_group))
    return out


def compute_logprobs(model: McoreModel, batches: PackedBatch | Sequence[PackedBatch], temperature: float = 1.0,
                     entropy: bool = True, *, loss_fn: Callable[[LogProbOutput, PackedBatch], torch.Tensor] | None = None,
                     mtp_loss_scale: float | None = None, trace: Counter | None = None):
    """Per-token float32 log-probs (and entropy) of each packed batch under the Megatron ``model``
    (``build_gpt_model``'s ``McoreModel``), aligned as ``actorcore.compute_logprobs``'s.

    Without ``loss_fn``: forward only, returns a ``LogProbOutput`` (a list for a list of batches) on every
    rank. With ``loss_fn(output, batch) -> scalar``: forward and backward through the pipeline schedule
    (gradients accumulate in the parameters; Megatron averages the loss over micro-batches); outputs are
    returned detached. Under context parallelism ``loss_fn`` sees the whole batch's outputs on every CP rank;
    each rank's gradients are its tokens' share times cp (Megatron's schedule scales the loss by cp), so
    averaging them over the data x context parallel ranks (Megatron's DDP) gives the whole batch's gradients.

    ``mtp_loss_scale`` (a model built with ``mtp=True``): also run the multi-token-prediction layers in this
    call; each output carries ``mtp_log_probs`` ``[mtp, T]`` (depth ``d`` scores token ``t + 1 + d`` from
    position ``t``, aligned to the scored token, 0 where nothing is scored; at temperature 1), and with
    ``loss_fn`` the loss becomes ``loss_fn(output, batch) + mtp_loss_scale * mtp_loss(output.mtp_log_probs,
    batch)`` (its gradient reaches the main model too, as in Megatron). The main head's log-probs are the same
    as without MTP.

    ``trace`` (a ``collections.Counter``): what ran is added to it (``mcore/run/call_plan.py`` lists the keys: the
    compiled layers, each layer's recompute mode, the grouped experts' forwards, the attention kernels).
    """
    model = require_model(model, "compute_logprobs")
    single = isinstance(batches, PackedBatch)
    batch_list = [batches] if single else list(batches)
    check_options(temperature=temperature, entropy=entropy)
    mtp_layers = _check_mtp(model, mtp_loss_scale)
    forward_only = loss_fn is None
    if not forward_only:
        _check_trainable(model.config)
    context, vocab_size = model.context, model.hf_config.vocab_size

    def head(chunk: Any, hidden_TD: torch.Tensor, batch: PackedBatch, shard: CpShard | None, index: int):
        pieces = hidden_TD.chunk(1 + mtp_layers, dim=0)  # main hidden states, then one block per MTP depth
        out = logprobs_from_hidden(chunk, pieces[0], batch, context, vocab_size=vocab_size, temperature=temperature,
                                   entropy=entropy, shard=shard)
        if mtp_layers:
            out.mtp_log_probs = mtp_logprobs_from_hidden(chunk, list(pieces[1:]), batch, context, vocab_size)
        loss = loss_fn(out, batch) if loss_fn is not None else hidden_TD.sum() * 0.0
        if mtp_layers and loss_fn is not None:
            loss = loss + mtp_loss_scale * mtp_loss(out.mtp_log_probs, batch)
        data = {"log_probs": out.log_probs.detach(), "entropy": None if out.entropy is None else out.entropy.detach(),
                "mtp": None if out.mtp_log_probs is None else out.mtp_log_probs.detach().flatten()}
        return loss, data

    with torch.set_grad_enabled(not forward_only):
        data = run_schedule(model, batch_list, head, forward_only=forward_only, run_mtp=bool(mtp_layers),
                            trace=check_trace(trace))
    outputs = _gathered_outputs(model, data, batch_list, entropy, mtp_layers)
    return outputs[0] if single else outputs


def _check_trainable(config: Any) -> None:
    """Refuse a forward-backward that megatron-core would get wrong or refuse under TP without SP."""
    if config.multi_latent_attention and config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise ValueError("forward-backward of a multi-latent-attention model (DeepSeek-V3) at tp > 1 needs "
                         "sequence parallelism (without it megatron-core's MLA drops part of the RoPE key's "
                         "gradient, see actorcore/mcore/build/mla.py): build the model with sequence_parallel=True")
    if config.num_moe_experts and config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise ValueError("forward-backward of a MoE model at tp > 1 needs sequence parallelism (megatron-core "
                         "refuses MoE training under tensor parallelism without it): do not pass "
                         "sequence_parallel=False to build_gpt_model (it is the default for MoE at tp > 1)")


def _gathered_outputs(model: McoreModel, data: list[dict], batch_list: list[PackedBatch], entropy: bool,
                      mtp_layers: int) -> list[LogProbOutput]:
    """Every rank's ``LogProbOutput``s from the last stage's per-micro-batch ``data``."""
    lengths = [b.num_real_tokens for b in batch_list]

    def shared(key: str, sizes: list[int]) -> list[torch.Tensor]:
        return _share_from_last_stage([d[key] for d in data] or [None] * len(sizes), sizes, model)

    log_probs = shared("log_probs", lengths)
    ent = shared("entropy", lengths) if entropy else None
    outputs = [LogProbOutput(log_probs=lp, entropy=None if ent is None else ent[i]) for i, lp in enumerate(log_probs)]
    if mtp_layers:
        for output, flat in zip(outputs, shared("mtp", [mtp_layers * n for n in lengths])):
            output.mtp_log_probs = flat.view(mtp_layers, -1)
    return outputs


def _check_mtp(model: McoreModel, mtp_loss_scale: float | None) -> int:
    """How many MTP depths this call runs (0 without ``mtp_loss_scale``); refuses what cannot run them."""
    if mtp_loss_scale is None:
        return 0
    if isinstance(mtp_loss_scale, bool) or not isinstance(mtp_loss_scale, (int, float)) or mtp_loss_scale < 0:
        raise ValueError(f"mtp_loss_scale must be a non-negative number (or None for no MTP), got {mtp_loss_scale!r}")
    if not model.mtp_layers:
        raise ValueError("mtp_loss_scale needs a model with multi-token-prediction layers: build it with "
                         "build_gpt_model(..., mtp=True)")
    if model.parallel.cp > 1:
        raise ValueError("multi-token prediction under context parallelism is not supported: Megatron's MTP rolls "
                         "each sequence's token ids across CP ranks in its own layout, which actorcore's CP split "
                         "(padded per sequence) has not been checked against; run MTP at cp=1")
    if model.config.pipeline_model_parallel_layout is not None:
        raise ValueError("multi-token prediction with a custom pipeline layout is not supported (the MTP layers "
                         "must be on the last stage)")
    return model.mtp_layers


def compute_values(model: McoreModel, batches: PackedBatch | Sequence[PackedBatch], *, trace: Counter | None = None):
    """Per-token float32 values ``[T]`` from a critic built with ``build_gpt_model(..., value_head=True)``
    (``trace`` as in ``compute_logprobs``)."""
    model = require_model(model, "compute_values")
    if not model.value_head:
        raise ValueError("compute_values needs a critic: build the model with build_gpt_model(..., value_head=True)")
    single = isinstance(batches, PackedBatch)
    batch_list = [batches] if single else list(batches)
    context = model.context

    def head(chunk: Any, hidden_TD: torch.Tensor, batch: PackedBatch, shard: CpShard | None, index: int):
        values = values_from_hidden(chunk, hidden_TD, batch, context, shard)
        return hidden_TD.sum() * 0.0, {"values": values.detach()}

    with torch.no_grad():
        data = run_schedule(model, batch_list, head, forward_only=True, trace=check_trace(trace))
    lengths = [b.num_real_tokens for b in batch_list]
    values = _share_from_last_stage([d["values"] for d in data] or [None] * len(lengths), lengths, model)
    return values[0] if single else values
