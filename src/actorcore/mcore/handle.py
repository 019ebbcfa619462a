"""``McoreModel``: one rank's Megatron model and the facts of its HF side, the one object every verb of the
Megatron route takes (load, forward, values, weight stream, save).

``build_gpt_model`` decides every field once; nothing of ours is set on Megatron's modules. ``chunks`` is the
plain list of Megatron ``GPTModel``s (one per pipeline stage of this rank, several with virtual stages), to hand
to Megatron's DDP and optimizer as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from actorcore._moved import renamed
from actorcore.archs.megatron_rules import McoreSpec
from actorcore.mcore.parallel import McoreParallel
from actorcore.mcore.build.recompute import RecomputePlan
from actorcore.parallel.context import ParallelContext

# How the checkpoint stores a MoE layer's experts: one tensor per expert (``experts.{e}.gate_proj.weight``), or
# stacked per layer (``experts.gate_up_proj`` ``[E, 2I, D]``, transformers 5's in-memory layout).
PER_EXPERT, GROUPED = "per_expert", "grouped"
EXPERT_LAYOUTS = (PER_EXPERT, GROUPED)


@dataclass(frozen=True, eq=False)
class McoreModel:
    """A Megatron model built by ``build_gpt_model``.

    ``hf_config``: the HF config the weights follow (for a VLM, its language model's ``text_config`` under the
    VLM's ``model_type``; the whole config is ``vlm_config``). ``spec``: the architecture's Megatron rules.
    ``expert_layout``: the layout the checkpoint stores the experts in (``per_expert`` or ``grouped``): load
    checks it, export writes it. ``mla_full_width_projections``: MLA kv down projections patched for exact
    gradients under TP + sequence parallelism (``mcore/build/mla.py``).

    The speed choices ``build_gpt_model`` resolved (each with a way off there): ``moe_experts``, the routed experts'
    kernel (``"grouped"``, ``"quack"``, ``"sequential"``; None without MoE layers, ``mcore/build/grouped_experts.py``);
    ``compiled_layers``, the layers' elementwise work compiled (``mcore/build/layer.py``); ``swiglu_mlp``, the dense
    MLPs of the compiled layers on quack's gated GEMMs (``"quack"``) or not (``False``); ``recompute``, the activation
    recompute plan (None: none; ``mcore/build/recompute.py``), and ``measured_layer_bytes``, what CUDA calls measured each
    layer to keep (by ``(layer index, mode)``), which ``recompute="auto"`` plans later calls with.
    """

    chunks: list[Any]
    hf_config: Any
    spec: McoreSpec
    parallel: McoreParallel
    context: ParallelContext
    vocab_multiple: int = 128
    value_head: bool = False
    vlm_config: Any = None
    expert_layout: str = PER_EXPERT
    mla_full_width_projections: int = 0
    moe_experts: str | None = None
    compiled_layers: bool = False
    recompute: RecomputePlan | None = None
    swiglu_mlp: str | bool = False
    measured_layer_bytes: dict[tuple[int, str], float] = field(default_factory=dict)

    @property
    def fused_layers(self) -> bool:
        """The old name of ``compiled_layers`` (kept for one release, with a DeprecationWarning)."""
        renamed("McoreModel.fused_layers", "McoreModel.compiled_layers")
        return self.compiled_layers

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, list) or not self.chunks:
            raise ValueError(f"chunks must be a non-empty list of Megatron modules, got {type(self.chunks).__name__}")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {self.expert_layout!r}")

    @property
    def config(self) -> Any:
        """Megatron's ``TransformerConfig`` (the same object in every chunk)."""
        return self.chunks[0].config

    @property
    def mtp_layers(self) -> int:
        """Multi-token-prediction layers the model was built with (0: none)."""
        return self.config.mtp_num_layers or 0

    @property
    def mtp_hf_layers(self) -> range:
        """HF indices of the MTP layers (``MtpRules.hf_layers``: ``num_hidden_layers + i`` or ``i``); empty without."""
        if not self.mtp_layers:
            return range(0)
        return self.spec.mtp.hf_layers(self.config.num_layers, self.mtp_layers)

    @property
    def token_multiple(self) -> int:
        """What a packed batch's token count is padded to before the forward (``McoreParallel.token_multiple``)."""
        return self.parallel.token_multiple(bool(self.config.sequence_parallel))

    @property
    def device(self) -> torch.device:
        return next(self.chunks[0].parameters()).device

    @property
    def weight_rules(self) -> McoreSpec:
        """The weight rules of this model: the spec in its expert layout, plus the MTP rules when it has MTP layers."""
        spec = self.spec.with_grouped_experts() if self.expert_layout == GROUPED else self.spec
        return spec.with_mtp() if self.mtp_layers else spec


def require_model(model: Any, verb: str) -> McoreModel:
    """``model`` if it is an ``McoreModel``, else a clear error naming the verb."""
    if not isinstance(model, McoreModel):
        raise ValueError(f"{verb} takes the McoreModel that actorcore.mcore.build_gpt_model returned, got "
                         f"{type(model).__name__}")
    return model
