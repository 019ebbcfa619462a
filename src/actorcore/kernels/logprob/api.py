"""Public entry point: ``linear_logprob_entropy`` and backend selection.

Shape suffixes: T tokens, D hidden, V vocab.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter

import torch

from actorcore.kernels.logprob._common import check_inputs
from actorcore.kernels.logprob.chunked import TorchChunkedEngine
from actorcore.kernels.logprob.function import LinearLogprobEntropyFunction
from actorcore.kernels.logprob.reference import linear_logprob_entropy_reference
from actorcore.kernels.trace import add

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "reference", "torch", "triton")


def triton_importable() -> bool:
    """True when the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def triton_supports(hidden_TD: torch.Tensor) -> tuple[bool, str]:
    """Whether the Triton backend handles this case, and if not, why."""
    if not hidden_TD.is_cuda:
        return False, "inputs are not on a CUDA device"
    if hidden_TD.dtype not in (torch.bfloat16, torch.float16):
        return False, f"the Triton kernels take bf16/fp16 inputs, got {hidden_TD.dtype}"
    if not triton_importable():
        return False, "triton is not installed"
    if hidden_TD.shape[0] == 0:
        return False, "no tokens"
    return True, ""


def select_engine(backend: str, hidden_TD: torch.Tensor, batch_invariant: bool = False):
    """A new engine for ``backend``; "auto" prefers Triton on CUDA when it applies.

    Engines are immutable options, made per call: nothing about the choice is kept between calls.
    ``batch_invariant``: an engine whose forward gives each token bitwise the same statistics whatever the
    other tokens of the call are (the reference backend has none: refused).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    if batch_invariant and backend == "reference":
        raise ValueError("backend='reference' is not batch-invariant (one matmul over all tokens); use 'auto', "
                         "'torch' or 'triton' with batch_invariant=True")
    if backend == "torch":
        return TorchChunkedEngine(batch_invariant=batch_invariant)
    ok, why = triton_supports(hidden_TD)
    if backend == "triton":
        if not ok:
            raise ValueError(f"backend='triton' cannot run here: {why}; use backend='torch' or 'auto'")
    elif not ok:
        return TorchChunkedEngine(batch_invariant=batch_invariant)
    try:
        from actorcore.kernels.logprob.triton_engine import TritonEngine
    except ImportError as err:  # triton present but unusable (e.g. a broken install)
        if backend == "triton":
            raise ValueError(f"backend='triton' cannot run here: importing triton failed: {err}") from err
        logger.warning("triton import failed (%s); using the chunked torch backend", err)
        return TorchChunkedEngine(batch_invariant=batch_invariant)
    return TritonEngine(batch_invariant=batch_invariant)


def linear_logprob_entropy(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
    softcap: float | None = None,
    trace: Counter[str] | None = None,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log_softmax(z)[label]`` and entropy of ``softmax(z)``, z = cap(hidden @ weight.T) / T.

    Logits are accumulated in fp32 and never rounded to 16 bits; outputs are float32 (float64 for
    float64 inputs). ``entropy=False`` returns None for the entropy and skips its cost. Labels must be
    in [0, V): callers mask ignored positions. Differentiable w.r.t. hidden and weight, through both
    outputs. ``chunk_size`` is tokens per chunk of the fast backends (None: a bounded default).
    ``trace``: counts what ran, backward included (keys in ``actorcore.kernels``).
    ``batch_invariant``: each token's outputs are bitwise the same whatever the other rows of ``hidden_TD``
    are and however many there are (fixed-size padded chunks, a fixed vocabulary split; the backward is not).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    check_inputs(
        hidden_TD, weight_VD, labels_T, temperature=temperature, softcap=softcap, chunk_size=chunk_size,
        entropy=entropy, trace=trace, batch_invariant=batch_invariant,
    )
    if backend == "reference" and not batch_invariant:
        add(trace, "logprob:reference")
        return linear_logprob_entropy_reference(
            hidden_TD, weight_VD, labels_T, temperature=temperature, entropy=entropy, softcap=softcap
        )
    engine = select_engine(backend, hidden_TD, batch_invariant)  # refuses reference + batch_invariant
    return LinearLogprobEntropyFunction.apply(
        hidden_TD,
        weight_VD,
        labels_T,
        engine,
        float(temperature),
        None if softcap is None else float(softcap),
        bool(entropy),
        chunk_size,
        None,
        trace,
    )
