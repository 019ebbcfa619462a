"""``verify``: actorcore's per-token outputs against the model's own Hugging Face forward.

``compute_logprobs(model, batch, temperature=T, entropy=True)`` (packed attention, fused head, the arch spec's
head transforms) is compared token by token with ``...ForCausalLM.forward`` run one sequence at a time on the
unpatched model (``hf/reference.py``): fp32 ``log_softmax(logits / T)`` at the next token, and its entropy.
A difference beyond the tolerance means the route computes something the model does not: a head transform or
config field the arch spec does not cover, or an attention / position difference.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from actorcore.batch import PackedBatch
from actorcore.errors import NonFiniteError, VerificationError  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

# Largest per-token |Δ| (log-prob and entropy) that verify accepts, by the model's parameter dtype.
# fp32: both sides compute in fp32 and differ by summation order (seen: 1e-6 and below on the tiny models).
# 16-bit: the model's own forward rounds its logits to 16 bits while actorcore's head computes them in fp32 from
# the same 16-bit hidden states, packed attention sums in another order, and an MoE router may pick another
# expert for a token that sits on a tie. Measured 2026-11-30 on the CPU with ``bench/verify_tolerances.py`` (the
# tiny model of every registered text arch and the embedded qwen3, seeds 0-2, random ids, lengths 7 to 257,
# temperature 1): largest |Δ log-prob| bf16 2.8e-2 (mixtral; dense archs 2.3e-3 to 5.8e-3), fp16 5.0e-3
# (mixtral); |Δ entropy| at most 1.7e-4. The bounds are about twice the largest seen; a deep model with large
# logits may need a larger ``tolerance=``, which is then worth stating next to the result.
VERIFY_TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.bfloat16: 6e-2,
    torch.float16: 1e-2,
}


@dataclass(frozen=True)
class VerifyReport:
    """Per-token comparison of actorcore with the model's own forward.

    ``worst_logprob_token`` / ``worst_entropy_token`` are ``(sequence index, position in that sequence)`` of the
    largest |Δ|. ``tokens`` counts the compared tokens: every token but each sequence's first (nothing predicts
    it; both sides give 0 there). ``plan``: on a model ``patch_model`` patched, the plan its calls ran with (every
    option's choice and why), so a report says which path was verified.
    """

    model_type: str
    dtype: str
    temperature: float
    tokens: int
    sequences: int
    max_abs_diff_logprob: float
    max_abs_diff_entropy: float
    worst_logprob_token: tuple[int, int]
    worst_entropy_token: tuple[int, int]
    tolerance: float
    plan: str | None = None  # the patch plan actorcore's side ran with (``handle.plan``), None on an unpatched model

    @property
    def ok(self) -> bool:
        return self.max_abs_diff_logprob <= self.tolerance and self.max_abs_diff_entropy <= self.tolerance

    def summary(self) -> str:
        verdict = "OK" if self.ok else "FAIL"
        patched = "" if self.plan is None else ", patched (report.plan)"
        return (f"{verdict}: {self.model_type} ({self.dtype}{patched}), {self.tokens} tokens in {self.sequences} "
                f"sequences: max |Δ log-prob| {self.max_abs_diff_logprob:.2e} at (sequence, position) "
                f"{self.worst_logprob_token}, max |Δ entropy| {self.max_abs_diff_entropy:.2e} at "
                f"{self.worst_entropy_token}, tolerance {self.tolerance:.1e}")

    def raise_if_failed(self) -> "VerifyReport":
        """Raise ``VerificationError`` saying what differs and what to do, unless ``ok``; return self."""
        if not self.ok:
            raise VerificationError(
                f"{self.summary()}. actorcore does not compute what {self.model_type}'s own forward computes: "
                "check that the arch spec declares every head transform the model applies after the decoder "
                "(final logit softcap, logit scaling, ...) and refuses the config fields it does not cover; for "
                "a 16-bit model whose differences are rounding, pass a larger tolerance=")
        return self


def default_tolerance(dtype: torch.dtype) -> float:
    """The table entry for a parameter dtype; unknown dtypes are an error."""
    if dtype not in VERIFY_TOLERANCE:
        raise ValueError(f"no verify tolerance for models in {dtype}; use one of "
                         f"{[str(d) for d in VERIFY_TOLERANCE]} or pass tolerance=")
    return VERIFY_TOLERANCE[dtype]


def _worst(diffs: list[torch.Tensor]) -> tuple[float, tuple[int, int]]:
    best, where = -1.0, (0, 0)
    for i, d in enumerate(diffs):
        if d.numel() and float(d.max()) > best:
            best, where = float(d.max()), (i, int(d.argmax()) + 1)  # position 0 is never compared
    return max(best, 0.0), where


def _refuse_non_finite_reference(model: Any, model_type: str, ref_lp: list[torch.Tensor],
                                 ref_ent: list[torch.Tensor]) -> None:
    """``NonFiniteError`` when the model's own forward gives NaN or inf (each sequence's first token aside): then
    there is nothing to compare with, and the cause is the model (its weights, or an overflow), not the arch spec."""
    bad = [i for i, (lp, ent) in enumerate(zip(ref_lp, ref_ent))
           if not (torch.isfinite(lp[1:]).all() and torch.isfinite(ent[1:]).all())]
    if not bad:
        return
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    names = [name for name, t in tensors if t.is_floating_point() and not torch.isfinite(t.detach()).all()]
    if names:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        cause = (f"its weights hold NaN or inf ({', '.join(names[:3])}{more}): the checkpoint is damaged or a "
                 "training step diverged; load finite weights")
    else:
        cause = "its weights are finite, so its forward overflows (16-bit activations?): verify it in float32"
    raise NonFiniteError(f"{model_type}'s own forward gives NaN or inf log-probs (sequence {bad[0]} of the batch), so "
                         f"there is nothing to compare actorcore with: {cause}")


def verify(model: Any, batch: PackedBatch, *, temperature: float = 1.0, tolerance: float | None = None,
           strict: bool = False) -> VerifyReport:
    """Compare ``compute_logprobs`` with the model's own forward per token; return a ``VerifyReport``.

    ``model`` is an HF ``...ForCausalLM`` (or a VLM's ``...ForConditionalGeneration``, with ``batch`` from
    ``actorcore.pack(..., multimodal=..., model=model)``); ``batch`` lives on the model's device. A model
    ``patch_model`` patched is verified as patched (its calls run the plan, the reference runs the model's own
    code), and the report carries the plan. ``tolerance`` defaults to ``VERIFY_TOLERANCE`` for the model's dtype.
    ``strict=True`` raises ``VerificationError`` on a failure. The model runs in eval mode (dropout off) and gets its
    mode back.
    """
    import actorcore as ac
    from actorcore.archs import spec_for_model
    from actorcore.hf.inputs import check_batch
    from actorcore.hf.call import patch_state
    from actorcore.hf.head import check_head_options
    from actorcore.hf.reference import reference_logprobs_per_sequence

    spec = spec_for_model(model)
    batch = check_batch(model, batch)
    temperature = check_head_options(temperature, True)
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real)
                                  or not 0 <= tolerance < math.inf):
        raise ValueError(f"tolerance must be None (the table's, by dtype) or a finite number >= 0, got {tolerance!r}")
    dtype = model.get_input_embeddings().weight.dtype
    tolerance = default_tolerance(dtype) if tolerance is None else float(tolerance)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = ac.compute_logprobs(model, batch, temperature=temperature, entropy=True)
        ref_lp, ref_ent = reference_logprobs_per_sequence(model, batch, temperature)
    finally:
        model.train(was_training)
    _refuse_non_finite_reference(model, spec.model_type, ref_lp, ref_ent)
    bounds = batch.cu_seqlens.tolist()
    diff_lp, diff_ent = [], []
    for i, (lp, ent) in enumerate(zip(ref_lp, ref_ent)):
        start, end = bounds[i] + 1, bounds[i + 1]  # the first token of a sequence is 0 on both sides
        # NaN becomes inf: it must fail, and NaN compares False with everything
        diff_lp.append((out.log_probs[start:end].float() - lp[1:].to(out.log_probs.device)).abs().nan_to_num(torch.inf))
        diff_ent.append((out.entropy[start:end].float() - ent[1:].to(out.entropy.device)).abs().nan_to_num(torch.inf))
    max_lp, worst_lp = _worst(diff_lp)
    max_ent, worst_ent = _worst(diff_ent)
    report = VerifyReport(
        model_type=spec.model_type, dtype=str(dtype).removeprefix("torch."), temperature=float(temperature),
        tokens=sum(int(d.numel()) for d in diff_lp), sequences=len(diff_lp), max_abs_diff_logprob=max_lp,
        max_abs_diff_entropy=max_ent, worst_logprob_token=worst_lp, worst_entropy_token=worst_ent,
        tolerance=tolerance, plan=None if patch_state(model) is None else str(patch_state(model).plan),
    )
    logger.info("verify: %s", report.summary())
    if strict:
        report.raise_if_failed()
    return report
