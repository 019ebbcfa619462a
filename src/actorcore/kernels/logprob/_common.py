"""Shared pieces of the log-prob/entropy backends: input checks, fp32 logits, per-token statistics.

Shape suffixes: T tokens, D hidden, V vocab (V may be one tensor-parallel shard of the vocabulary).

Every backend reduces a token's logits to four per-token partial statistics over the vocabulary it
holds, with z = cap(logits) / temperature:

    m  = max_j z_j
    s  = sum_j exp(z_j - m)
    a  = sum_j exp(z_j - m) * (z_j - m)        (only when entropy is wanted)
    zy = z_label if the label is in this vocabulary range, else 0

``merge_partial_stats`` merges partials of disjoint vocabulary ranges (the Triton forward's splits, or
the ranks of a tensor-parallel group once the caller has gathered them: kernels issue no collectives)
and ``finish_stats`` turns them into logsumexp, log-prob and entropy:

    lse = m + log s,  logprob = zy - lse,  entropy = log s - a / s

Keeping (z - m) inside ``a`` avoids the cancellation of ``lse - sum p z`` for large logits.
"""

from __future__ import annotations

import logging
import math
import numbers

import torch

from actorcore.kernels.trace import check_trace

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 inputs compute (and return) float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_inputs(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    temperature: float,
    softcap: float | None,
    chunk_size: int | None = None,
    entropy: bool = True,
    trace: object = None,
    labels_in_range: bool = True,
    batch_invariant: bool = False,
) -> None:
    """Cheap validation shared by all backends; raises ValueError that says what to fix.

    The label range check needs a device sync, so it runs on CPU tensors only.
    """
    if not isinstance(hidden_TD, torch.Tensor) or hidden_TD.dim() != 2:
        raise ValueError(f"hidden_TD must be a 2-D [tokens, hidden] tensor, got {_desc(hidden_TD)}")
    if not isinstance(weight_VD, torch.Tensor) or weight_VD.dim() != 2:
        raise ValueError(f"weight_VD must be a 2-D [vocab, hidden] tensor, got {_desc(weight_VD)}")
    if not isinstance(labels_T, torch.Tensor) or labels_T.dim() != 1:
        raise ValueError(f"labels_T must be a 1-D [tokens] tensor, got {_desc(labels_T)}")
    if hidden_TD.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden_TD dtype must be one of {_FLOAT_DTYPES}, got {hidden_TD.dtype}")
    if weight_VD.dtype != hidden_TD.dtype:
        raise ValueError(
            f"hidden_TD and weight_VD must have the same dtype, got {hidden_TD.dtype} and {weight_VD.dtype}"
        )
    if labels_T.dtype not in _INT_DTYPES:
        raise ValueError(f"labels_T must be int32 or int64, got {labels_T.dtype}")
    if hidden_TD.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden_TD is {tuple(hidden_TD.shape)}, weight_VD is {tuple(weight_VD.shape)}"
        )
    if labels_T.shape[0] != hidden_TD.shape[0]:
        raise ValueError(
            f"labels_T has {labels_T.shape[0]} tokens but hidden_TD has {hidden_TD.shape[0]}"
        )
    if weight_VD.shape[0] == 0:
        raise ValueError("weight_VD has an empty vocabulary")
    if hidden_TD.device != weight_VD.device or labels_T.device != hidden_TD.device:
        raise ValueError(
            f"all inputs must be on one device, got hidden {hidden_TD.device}, weight {weight_VD.device}, "
            f"labels {labels_T.device}; move them to the weight's device (e.g. hidden_TD.to(weight_VD.device))"
        )
    check_options(temperature=temperature, softcap=softcap, chunk_size=chunk_size, entropy=entropy, trace=trace,
                  batch_invariant=batch_invariant)
    if labels_in_range and labels_T.device.type == "cpu" and labels_T.numel() > 0:
        lo, hi = int(labels_T.min()), int(labels_T.max())
        if lo < 0 or hi >= weight_VD.shape[0]:
            raise ValueError(
                f"labels_T must lie in [0, {weight_VD.shape[0]}), got min {lo} max {hi}; "
                "mask ignored positions (e.g. -100) before calling"
            )


def _positive_finite(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_options(
    *, temperature: float = 1.0, softcap: float | None = None, chunk_size: int | None = None, entropy: bool = True,
    trace: object = None, batch_invariant: bool = False,
) -> None:
    """The scalar options of every head entry point (kernels and routes): refuse what would silently mislead.

    ``True`` is not a temperature, ``"yes"`` not a flag, NaN / inf / 0 not a scale.
    """
    if not _positive_finite(temperature):
        raise ValueError(f"temperature must be a finite positive number (e.g. 1.0), got {temperature!r}")
    if softcap is not None and not _positive_finite(softcap):
        raise ValueError(f"softcap must be None or a finite positive number, got {softcap!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    if not isinstance(entropy, bool):
        raise ValueError(f"entropy must be True or False, got {entropy!r}")
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    check_trace(trace)


def _desc(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__}"


def mm_out_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a @ b`` accumulated and returned in fp32 from 16-bit operands, or None if unsupported.

    Uses ``torch.mm(..., out_dtype=torch.float32)`` (cuBLAS writes the fp32 accumulator directly), so
    neither a rounded bf16 product nor an fp32 copy of the operands is made. Tried on every call (an
    unsupported combination fails at dispatch, before any work), so no process-wide cache decides it.
    """
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        logger.debug("torch.mm(out_dtype=float32) unsupported for %s %s: %s", a.device.type, a.dtype, err)
        return None


def merge_partial_stats(
    m_ST: torch.Tensor, s_ST: torch.Tensor, a_ST: torch.Tensor | None, zy_ST: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Statistics of S disjoint vocabulary ranges ([S, T] each) -> those of their union ([T] each).

    Summed in index order, so the result is deterministic.
    """
    if m_ST.shape[0] == 1:
        return m_ST[0], s_ST[0], (a_ST[0] if a_ST is not None else None), zy_ST[0]
    m_T = m_ST.amax(dim=0)
    scale_ST = torch.exp(m_ST - m_T)
    s_T = (s_ST * scale_ST).sum(dim=0)
    a_T = None
    if a_ST is not None:
        a_T = (scale_ST * (a_ST + (m_ST - m_T) * s_ST)).sum(dim=0)
    return m_T, s_T, a_T, zy_ST.sum(dim=0)


def finish_stats(
    m_T: torch.Tensor, s_T: torch.Tensor, a_T: torch.Tensor | None, zy_T: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Whole-vocabulary statistics -> (lse, logprob, entropy or None)."""
    log_s = torch.log(s_T)
    lse = m_T + log_s
    logprob = zy_T - lse
    ent = log_s - a_T / s_T if a_T is not None else None
    return lse, logprob, ent
