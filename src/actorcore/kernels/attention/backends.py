"""Which kernel runs the packed attention: the backends, their availability probes, what each refuses, and the
``"auto"`` rule.

Backends:
- ``fa4``: FlashAttention-4's CuTe DSL kernels (``kernels.attention.fa4``; Hopper, 16-bit; windows, softcap, sinks;
  no dropout).
- ``flash_attn``: flash-attn 2's varlen kernel (CUDA, when installed); windows, softcap, dropout.
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn``, FlashAttention-2 inside torch (CUDA; no softcap, no
  dropout).
- ``segments``: one SDPA call per sequence (any device); an exact eager softmax with softcap or sinks.

``"auto"`` (``choose_backend``): on CUDA with 16-bit inputs, FA4 where ``FA4_MEASURED`` says so for this GPU and FA4
takes the call; else attention sinks on ``segments`` (the one other backend that applies them), else flash-attn 2
where installed, else torch's varlen kernel where it covers the call; ``segments`` everywhere else.
``resolve_backend`` states what a request comes to, with the reason, for a patch's report; an explicit backend that
cannot run a call is refused with the reason (``backend_refusal``), never swapped for another.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch

from actorcore.kernels.attention.fa4 import fa4_refusal

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "fa4", "flash_attn", "torch_varlen", "segments")
FLASH_DTYPES = (torch.float16, torch.bfloat16)

# Where "auto" takes FA4: measured facts per compute capability, added after a GPU run, never guessed.
#   "exact":  tests/gpu/test_fa4_attention_cuda.py passed on that GPU; "auto" takes FA4 only for attention that no
#             other flash kernel here runs (sinks; softcap without flash-attn 2), which would otherwise run the
#             per-sequence ``segments`` path.
#   "faster": exact, and bench/attention_backends.py measured FA4's forward+backward ahead of FA2 on the RL packs and
#             the long sequences (docs/benchmarks.md, with date and command); "auto" takes FA4 for all it covers.
# Elsewhere "auto" keeps FA2 and the other backends, and FA4 runs when asked for (backend="fa4").
# (9, 0), Hopper: the kernel tests passed on the H100 (2026-12-06) and the HF-route tests on the H200 (2026-12-07),
# but for gpt-oss's absolute gradient cap, which the per-sequence baseline missed too (FA4 was the closer of the two);
# with that check per parameter the HF-route tests passed on the H100 (2026-12-07); FA4's kernels 1.73-1.82x FA2's
# on the RL packs, 1.70x on 256K tokens (H100), the actor steps 1.08-1.13x (H200; docs/benchmarks.md).
FA4_MEASURED: Mapping[tuple[int, int], str] = MappingProxyType({(9, 0): "faster"})


@functools.cache
def _has_flash_attn() -> bool:
    """flash-attn 2 is installed: its CUDA extension, not the ``flash_attn`` name, which flash-attn-4 also uses
    (``flash_attn.cute``) without flash-attn 2's ``flash_attn_varlen_func``."""
    return importlib.util.find_spec("flash_attn_2_cuda") is not None


@functools.cache
def _has_torch_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device`` (None off CUDA)."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def _fa4_for_auto(device: torch.device, dtype: torch.dtype, softcap: float | None, dropout: float, sinks: bool,
                  head_dim: int | None, window: bool) -> bool:
    """Whether ``"auto"`` takes FA4 for this call (``FA4_MEASURED``, and FA4 takes the call)."""
    if not FA4_MEASURED or head_dim is None:
        return False
    measured = FA4_MEASURED.get(device_capability(device))
    if measured is None:
        return False
    if measured == "exact" and not (sinks or (softcap is not None and not _has_flash_attn())):
        return False
    why = fa4_refusal(device, dtype, head_dim, device_capability(device), dropout=dropout, window=window,
                      softcap=softcap is not None, sinks=sinks)
    if why is not None:
        logger.debug("attention 'auto' does not take FA4 here: %s", why)
    return why is None


def choose_backend(device: torch.device, dtype: torch.dtype, softcap: float | None, dropout: float,
                   sinks: bool = False, *, head_dim: int | None = None, window: bool = False, fa4: bool = True) -> str:
    """The backend ``"auto"`` resolves to for these arguments (see the module docstring). ``head_dim``: the one head
    dim a flash kernel sees (the larger of q/k's and v's; None: FA4 is not considered); ``window``: a sliding window;
    ``fa4=False``: FA4 is not a candidate (callers whose layouts only the other flash kernels take)."""
    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return "segments"
    if fa4 and _fa4_for_auto(device, dtype, softcap, dropout, sinks, head_dim, window):
        return "fa4"
    if sinks:
        return "segments"
    if _has_flash_attn():
        return "flash_attn"
    if _has_torch_varlen() and softcap is None and dropout == 0.0:
        return "torch_varlen"
    return "segments"


def backend_refusal(backend: str, device: torch.device, dtype: torch.dtype, *, softcap: float | None = None,
                    dropout: float = 0.0, sinks: bool = False, window: bool = False, head_dim: int) -> str | None:
    """Why an explicitly requested backend cannot run attention with these arguments (None: it can)."""
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; choose one of {BACKENDS}"
    if backend in ("auto", "segments"):
        return None
    if backend == "fa4":
        return fa4_refusal(device, dtype, head_dim, device_capability(device), dropout=dropout, window=window,
                           softcap=softcap is not None, sinks=sinks)
    if sinks:
        return f"the {backend} backend cannot apply attention sinks; use backend='segments', 'fa4' or 'auto'"
    if backend == "torch_varlen" and (softcap is not None or dropout):
        return "the torch_varlen backend supports neither softcap nor dropout; use 'segments'"
    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return (f"the {backend} backend runs fp16 / bf16 inputs on CUDA devices, not {dtype} on {device.type}; use "
                "'segments' or 'auto'")
    if backend == "flash_attn" and not _has_flash_attn():
        return "flash-attn 2 is not installed (pip install flash-attn); use 'torch_varlen', 'segments' or 'auto'"
    if backend == "torch_varlen" and not _has_torch_varlen():
        return "this torch has no torch.nn.attention.varlen.varlen_attn; use 'segments' or 'auto'"
    return None


@dataclass(frozen=True)
class BackendChoice:
    """What an attention backend request resolves to on a device and dtype, and why (a patch's report)."""

    requested: str
    backend: str
    reason: str

    def __str__(self) -> str:
        return f"{self.backend} ({self.reason})"


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, *, head_dim: int,
                    softcap: float | None = None, dropout: float = 0.0, sinks: bool = False,
                    window: bool = False) -> BackendChoice:
    """The backend ``requested`` comes to for attention of these arguments, with the reason; raises ``ValueError``
    with the reason for an explicit backend that cannot run it. Each call still resolves ``"auto"`` itself
    (``choose_backend``) from its own tensors: this is what the model's device, dtype and config lead to."""
    why = backend_refusal(requested, device, dtype, softcap=softcap, dropout=dropout, sinks=sinks, window=window,
                          head_dim=head_dim)
    if why is not None:
        raise ValueError(f"attention_backend={requested!r}: {why}; pass attention_backend='auto' (FA4 where measured, "
                         "else FlashAttention-2) or another backend")
    if requested != "auto":
        return BackendChoice(requested, requested, "asked for")
    backend = choose_backend(device, dtype, softcap, dropout, sinks, head_dim=head_dim, window=window)
    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return BackendChoice("auto", backend, "flash kernels need CUDA and 16-bit inputs")
    capability = device_capability(device)
    sm = f"sm{capability[0]}{capability[1]}"
    measured = FA4_MEASURED.get(capability)
    if backend == "fa4":
        return BackendChoice("auto", backend, f"FA4 measured {measured} on {sm}")
    if measured is None:
        return BackendChoice("auto", backend, f"FA4 not measured on {sm} (kernels.attention.backends.FA4_MEASURED)")
    why = fa4_refusal(device, dtype, head_dim, capability, dropout=dropout, window=window,
                      softcap=softcap is not None, sinks=sinks)
    return BackendChoice("auto", backend, why or f"FA4 measured {measured} only on {sm}, and {backend} covers this "
                         "attention")
