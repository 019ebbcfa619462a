"""Whether quack's Hopper GEMMs (``quack-kernels``, Tri Dao's CuTe-DSL kernels) can run here, and their entry point.

quack is an optional dependency: imported lazily, taken only where ``quack_refusal`` passes.
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

import torch

INSTALL_HINT = "pip install quack-kernels==0.6.4 'nvidia-cutlass-dsl[cu13]==4.6.2' ([cu12] on CUDA 12)"


def _dsl_requirement(quack_requires: list[str]) -> str | None:
    """The version specifier quack's metadata puts on nvidia-cutlass-dsl (``"==4.6.2"``), or None."""
    for requirement in quack_requires:
        match = re.match(r"nvidia-cutlass-dsl(?![-\w])(\[[^\]]*\])?\s*([^;]*)(;.*)?$", requirement.strip())
        if match and "extra" not in (match.group(3) or ""):
            return match.group(2).strip() or None
    return None


def quack_refusal() -> str | None:
    """Why quack's fused GEMMs cannot run here (None: they can).

    quack compiles its kernels with the CuTe DSL on first use and keys them by what its epilogues depend on inside
    the DSL, so a DSL release quack was not built against fails at the first GEMM (measured on the H200:
    quack-kernels 0.6.5, whose requirement is the range ``>=4.7``, raises TypeError with nvidia-cutlass-dsl 4.7.1
    and 4.8.1). Taken: a quack that pins the DSL exactly, with that DSL installed."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return "quack's fused GEMMs need a Hopper (sm90) or newer CUDA GPU"
    try:
        quack_version = importlib.metadata.version("quack-kernels")
        dsl = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return f"quack-kernels or nvidia-cutlass-dsl is not installed ({INSTALL_HINT})"
    pinned = _dsl_requirement(importlib.metadata.requires("quack-kernels") or [])
    if pinned is None or not pinned.startswith("==") or pinned[2:] != dsl:
        return (f"quack-kernels {quack_version} asks for nvidia-cutlass-dsl{pinned or ' (any)'} and "
                f"{dsl} is installed: only a quack that pins the DSL exactly, with that DSL, is taken ({INSTALL_HINT})")
    return None


def width_refusal(name: str, **widths: int) -> str | None:
    """Why quack's GEMMs cannot take these operand widths (None: they can): its tile loads move 16-byte rows, so
    every width of a 16-bit operand must be a multiple of 8 elements."""
    odd = [f"{key}={value}" for key, value in widths.items() if value % 8]
    if odd:
        return f"{name} has widths quack's 16-byte loads cannot take ({', '.join(odd)}: not multiples of 8)"
    return None


def gemm_interface() -> Any:
    """quack's GEMM module (``quack.gemm_interface``), imported on first use."""
    from quack import gemm_interface as interface

    return interface
