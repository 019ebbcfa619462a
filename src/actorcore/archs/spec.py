"""What generic code needs to know about one Hugging Face ``model_type``, as data.

Each ``archs/<model_type>.py`` defines ``SPEC = ArchSpec(...)`` (usually ``dataclasses.replace`` of a
sibling). Generic code reads specs; it never branches on ``model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# MLP kinds the generic code knows. "gated": down(act(gate(x)) * up(x)) (SwiGLU, GeGLU);
# "fused_gated": the same with gate and up in one projection (phi3); "plain": down(act(up(x)));
# "moe": a router plus experts.
MLP_KINDS = ("gated", "fused_gated", "plain", "moe")


@dataclass(frozen=True)
class ArchSpec:
    """Declarative facts about one architecture.

    Paths are dotted attribute paths. ``decoder`` is relative to the task model (``...ForCausalLM``,
    ``...ForTokenClassification``); ``layers`` to the decoder; ``mlp`` and ``attention`` to one layer.
    """

    model_type: str
    decoder: str = "model"
    layers: str = "layers"
    attention: str = "self_attn"
    mlp: str = "mlp"
    mlp_kind: str = "gated"
    # The critic's 1-output head on ``...ForTokenClassification`` models.
    value_head: str = "score"
    # Config field holding a final-logit softcap (Gemma 2); applied exactly by the log-prob head.
    final_logit_softcap_field: str | None = None
    # Config fields that must be falsy/None for this spec to be valid, with the reason if they are not.
    unsupported_config: tuple[tuple[str, str], ...] = ()
    # Layers whose MLP kind differs (MoE models with dense layers): config-driven, resolved at use.
    notes: str = ""
    # Megatron-Core part (conversion rules, config overrides); filled by the Megatron route.
    mcore: Any = None
    # Vision-language part (vision tower, rope-index function, feature merging); filled for VLMs.
    vision: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(f"{self.model_type}: mlp_kind {self.mlp_kind!r} is not one of {MLP_KINDS}")


class UnsupportedArchitectureError(ValueError):
    """The model's architecture is not registered, or uses a feature actorcore refuses."""
