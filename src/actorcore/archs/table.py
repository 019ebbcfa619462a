"""The supported-models table, rendered from the registry (``actorcore models`` prints it; docs/models.md holds it).

Every cell comes from ``actorcore.archs.support``, the functions the routes refuse through, so the table cannot
claim what the code does not do.
"""

from __future__ import annotations

from typing import Callable

from actorcore.archs import get_spec, registered_model_types
from actorcore.archs.spec import ArchSpec
from actorcore.archs.support import (
    batch_invariant_refusal,
    hf_route_refusal,
    is_vlm,
    megatron_refusal,
    sequence_parallel_refusal,
    tiled_mlp_refusal,
)

COLUMNS: tuple[tuple[str, Callable[[ArchSpec], bool]], ...] = (
    ("HF route", lambda spec: hf_route_refusal(spec) is None),
    ("SP", lambda spec: sequence_parallel_refusal(spec) is None),
    ("tiled MLP", lambda spec: tiled_mlp_refusal(spec) is None),
    ("batch-invariant", lambda spec: batch_invariant_refusal(spec) is None),
    ("Megatron", lambda spec: megatron_refusal(spec) is None),
    ("VLM", is_vlm),
)


def models_table(model_types: list[str] | None = None) -> str:
    """A markdown table: one row per ``model_type`` (default: every registered one), ``yes`` / ``no`` per column."""
    names = registered_model_types() if model_types is None else model_types
    header = ["model_type"] + [title for title, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name in names:
        spec = get_spec(name)
        cells = [f"`{name}`"] + ["yes" if supported(spec) else "no" for _, supported in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
