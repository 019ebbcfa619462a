"""What each architecture supports, read from its spec: every function returns why a feature is refused, or None.

The routes refuse through these functions, and the supported-models table (``actorcore.archs.table``) is rendered
from them, so the table says what the code does. Refusals that depend on the config (heads that do not split over
an SP size, a logit transform the spec does not apply) are the call's, not the architecture's, and are not here.
"""

from __future__ import annotations

from actorcore.archs.spec import ArchSpec


def hf_route_refusal(spec: ArchSpec) -> str | None:
    """Why the Hugging Face route refuses the architecture outright (registered only to be refused), or None."""
    if spec.vision is not None and spec.vision.refused:
        return spec.vision.refused
    return dict(spec.unsupported_config).get("model_type")


def sequence_parallel_refusal(spec: ArchSpec) -> str | None:
    """Ulysses SP splits the attention heads (and linear-attention heads) of every layer kind the HF route runs."""
    return hf_route_refusal(spec)


def tiled_mlp_refusal(spec: ArchSpec) -> str | None:
    if spec.mlp_kind == "moe":
        return ("its MLP is a mixture of experts (mlp_kind='moe'), whose blocks route tokens to experts (and may "
                "return router outputs), which tiled recompute does not cover")
    return hf_route_refusal(spec)


def batch_invariant_refusal(spec: ArchSpec) -> str | None:
    if spec.mlp_kind == "moe":
        return ("its MLP is a mixture of experts: the router's choices and each expert's matmul row count depend "
                "on the other tokens of the batch")
    if spec.linear_attention is not None:
        return "its linear-attention layers are not covered by the batch-invariant mode"
    if spec.vision is not None:
        return "its vision tower is not covered by the batch-invariant mode"
    return hf_route_refusal(spec)


def megatron_refusal(spec: ArchSpec) -> str | None:
    return spec.mcore.refused


def is_vlm(spec: ArchSpec) -> bool:
    """A vision-language model the HF route runs (images and videos through its vision tower)."""
    return spec.vision is not None and not spec.vision.refused
