"""One packed decoder pass of a Hugging Face model.

Legend: ``T`` packed tokens (this rank's shard under SP), ``D`` hidden.

The decoder runs on the packed batch (no padding, nothing across sequences): the packing metadata
(``cu_seq_lens_q/k``, ``max_length_q/k``), the call's ``ParallelContext`` and its trace travel as explicit
keyword arguments down to the attention functions. Under Ulysses sequence parallelism each rank runs its
contiguous shard of the padded batch. Everything else the pass does is a decoder feature (the one list:
``hf.features.DECODER_FEATURES``), entered around the forward and checked after it (``hf.features.base``); the
call's trace records which features ran (``plan:<feature>``) and which stood down for it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch

from actorcore.archs import ArchSpec, spec_for_model
from actorcore.batch import PackedBatch, pad_to_multiple, shard_for_sp
from actorcore.hf.features.batch_invariant import check_batch_invariant_support
from actorcore.hf.call import (PARALLEL_KWARG, TRACE_KWARG, CallPlan, DecoderCall, DecoderParts, ParallelRef, TraceRef,
                               patch_state)
from actorcore.hf.features import DECODER_FEATURES
from actorcore.hf.inputs import check_batch
from actorcore.kernels.trace import check_trace
from actorcore.parallel import sp_size


def decoder_call(model: Any, batch: PackedBatch, parallel: Any = None, trace: Counter | None = None, *,
                 check_finite: bool = False, batch_invariant: bool = False,
                 spec: ArchSpec | None = None) -> DecoderCall:
    """The ``DecoderCall`` of one packed pass, its inputs checked (before any forward: bad input costs nothing).

    ``batch_invariant``: each token's hidden states do not depend on the rest of the pack (``hf.features.batch_invariant``).
    """
    spec = spec_for_model(model) if spec is None else spec
    patch = patch_state(model)
    standing_down: frozenset = frozenset()
    if batch_invariant:
        check_batch_invariant_support(spec)
        if patch is not None:
            why = patch.plan.batch_invariant_refusal
            if why is not None:
                raise ValueError(f"batch_invariant=True on {type(model).__name__}: {why}")
            standing_down = frozenset(patch.plan.stands_down_in_batch_invariant_calls())
    sp_size(parallel)
    batch = check_batch(model, batch)
    work = batch if sp_size(parallel) == 1 else pad_to_multiple(batch, sp_size(parallel))
    trace = Counter() if check_trace(trace) is None else trace
    return DecoderCall(model=model, spec=spec, parts=DecoderParts.of(model, spec), batch=work, parallel=parallel,
                       trace=trace, patch=patch, check_finite=check_finite, batch_invariant=batch_invariant,
                       standing_down=standing_down)


def _decoder_kwargs(call: DecoderCall) -> dict[str, Any]:
    """This rank's input ids / position ids and the packing metadata, as the decoder's keyword arguments."""
    work, sp = call.batch, call.sp_size
    input_ids, position_ids = work.input_ids, work.position_ids
    if sp > 1:
        rank = int(call.parallel.sp_rank)
        input_ids, position_ids = shard_for_sp(input_ids, rank, sp), shard_for_sp(position_ids, rank, sp)
    cu = work.cu_seqlens
    return dict(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids.unsqueeze(1),
        use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=work.max_seqlen,
        max_length_k=work.max_seqlen, **{PARALLEL_KWARG: ParallelRef(call.parallel), TRACE_KWARG: TraceRef(call.trace)},
    )


def _record_plan(call: DecoderCall, active: list) -> None:
    """The call's plan as it runs: ``plan:<feature>`` per feature entered and ``plan:stood_down:<feature>`` per
    patched feature standing down, in the call's trace; on a patched model also the patch's latest calls."""
    for feature in active:
        call.trace[f"plan:{feature.name}"] += 1
    for name in sorted(call.standing_down):
        call.trace[f"plan:stood_down:{name}"] += 1
    if call.patch is not None:
        call.patch.calls.append(CallPlan(tuple(f.name for f in active), tuple(sorted(call.standing_down)),
                                         call.batch_invariant, call.model.training and torch.is_grad_enabled()))


def run_decoder(call: DecoderCall) -> torch.Tensor:
    """The packed decoder pass of ``call``: this rank's final hidden states ``[T, D]`` (of ``call.batch``, the
    batch as run).

    Every active feature enters the forward, in ``DECODER_FEATURES`` order, and checks afterwards that it ran (a
    ``FastPathNotRunError`` subclass if not: e.g. ``PackingNotAppliedError`` when actorcore's attention did not
    run in every layer); ``check_finite`` raises ``NonFiniteError`` at the first layer whose output holds NaN or
    inf.
    """
    call.kwargs.update(_decoder_kwargs(call))
    active = [feature for feature in DECODER_FEATURES if feature.active(call)]
    _record_plan(call, active)
    with contextlib.ExitStack() as stack:
        for feature in active:
            stack.enter_context(feature.enter(call))
        out = call.parts.decoder(**call.kwargs)
    call.hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    for feature in active:
        feature.check(call)
    return call.hidden[0]
