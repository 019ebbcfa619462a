"""The probe that verifies a rollout engine after a weight update: a fixed token sequence whose per-token log-probs
the engine and the trainer both compute, compared token by token.

Why a probe and not checksums of the engine's tensors: an engine keeps its weights in its own layout after loading
(vLLM's CPU build repacks every linear layer into an opaque handle), and what must be true is that the engine
*computes* with the trainer's weights: layers repacked again, tied heads refreshed, no stale prefix cache. Every
log-prob of the probe depends on the lm-head's every row (the softmax's normaliser) and on every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from actorcore.batch import PackedBatch

# (max |d log-prob|, mean |d log-prob|) in nats, per engine dtype. float32: the engine and the trainer agree to
# float32 rounding (measured about 1e-6 on the CPU build), so this separates any stale or wrong weight. 16-bit: two
# implementations' kernels round differently (measured up to 3.4e-3 on tiny models, more on large ones); the probe
# then catches wrong layers (a stale tied head was 1.1 nats off, unrepacked experts 4-6) and, with the check against
# the previous update, an engine that did not move at all.
DEFAULT_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-4, 1e-5),
    torch.bfloat16: (1.0, 0.05),
    torch.float16: (0.5, 0.02),
}


def probe_tokens(vocab_size: int, length: int, seed: int = 0) -> PackedBatch:
    """One sequence of ``length`` token ids drawn from the whole vocabulary with a fixed seed."""
    from actorcore.hf.packing import pack

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(vocab_size), (int(length),), generator=generator)
    return pack([ids])


@dataclass
class ProbeResult:
    """The probe's agreement: ``max_abs`` / ``mean_abs`` over ``tokens`` scored tokens (the prompt's and the
    generated ones); ``ok`` and, when not, ``reason``. ``engine`` / ``trainer``: the per-token log-probs compared."""

    max_abs: float
    mean_abs: float
    tokens: int
    ok: bool
    reason: str
    engine: torch.Tensor
    trainer: torch.Tensor
    prompt_scored: int = 0  # the first this many of ``engine`` / ``trainer`` score the probe's prompt


def compare_probe(engine: dict[str, Any], reference: Callable[[PackedBatch], torch.Tensor], dtype: torch.dtype,
                  tolerance: tuple[float, float] | None, previous: ProbeResult | None = None) -> ProbeResult:
    """``engine``: the engine's log-probs of the probe prompt (``prompt``, 0 at the first token) and of the tokens
    it generated after it (``generated_ids``, ``generated``). ``reference`` scores the same tokens for the trainer.
    """
    from actorcore.hf.packing import pack

    prompt_lp = engine["prompt"].float()
    prompt_ids = _prompt_ids(engine, prompt_lp)
    ids = torch.cat([prompt_ids, torch.tensor(engine["generated_ids"], dtype=torch.long)])
    trainer_all = reference(pack([ids])).float().cpu().reshape(-1)
    if trainer_all.numel() != ids.numel():
        raise ValueError(f"the reference returned {trainer_all.numel()} log-probs for {ids.numel()} tokens")
    engine_all = torch.cat([prompt_lp, engine["generated"].float()])
    # the first token has nothing predicting it: compare from the second on
    engine_scored, trainer_scored = engine_all[1:], trainer_all[1:]
    prompt_scored = prompt_lp.numel() - 1
    diff = (engine_scored - trainer_scored).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    mean_abs = float(diff.mean()) if diff.numel() else 0.0
    max_tol, mean_tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE.get(dtype, (1.0, 0.05))
    reasons = []
    if not torch.isfinite(engine_scored).all():
        reasons.append("the engine's log-probs are not finite")
    if max_abs > max_tol or mean_abs > mean_tol:
        worst = int(diff.argmax()) + 1
        reasons.append(f"max |engine - trainer| {max_abs:.3g} nats (tolerance {max_tol:g}) at probe token {worst}, "
                       f"mean {mean_abs:.3g} (tolerance {mean_tol:g}) over {diff.numel()} tokens")
    stale = _unmoved(previous, engine_scored[:prompt_scored], trainer_scored[:prompt_scored])
    if stale:
        reasons.append(stale)
    return ProbeResult(max_abs=max_abs, mean_abs=mean_abs, tokens=int(diff.numel()), ok=not reasons,
                       reason="; ".join(reasons), engine=engine_scored, trainer=trainer_scored,
                       prompt_scored=prompt_scored)


def _prompt_ids(engine: dict[str, Any], prompt_lp: torch.Tensor) -> torch.Tensor:
    ids = engine.get("prompt_ids")
    if ids is None:
        raise ValueError("the engine's probe result must carry the probe's prompt_ids")
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if ids.numel() != prompt_lp.numel():
        raise ValueError(f"{ids.numel()} probe tokens but {prompt_lp.numel()} prompt log-probs")
    return ids


def _unmoved(previous: ProbeResult | None, engine: torch.Tensor, trainer: torch.Tensor) -> str:
    """An engine whose probe log-probs are bitwise what they were at the last verification while the trainer's
    moved is stale, however small the move (a 16-bit engine's tolerance could otherwise hide it)."""
    if previous is None:
        return ""
    n = min(previous.prompt_scored, engine.numel())
    trainer_moved = bool((previous.trainer[:n] != trainer[:n]).any())
    engine_moved = bool((previous.engine[:n] != engine[:n]).any())
    if trainer_moved and not engine_moved:
        return ("the engine's probe log-probs are bitwise those of the previous update while the trainer's changed: "
                "the engine still computes with the old weights")
    return ""
