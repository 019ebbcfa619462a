"""What generic code needs to know about one Hugging Face ``model_type``, as data.

Each ``archs/<model_type>.py`` defines ``SPEC = ArchSpec(...)`` (often ``dataclasses.replace`` of a
sibling, restating its Megatron part: the registry refuses a spec that shares another's). Generic code reads
specs; it never branches on ``model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actorcore.archs.megatron_rules import McoreSpec
from actorcore.errors import UnsupportedArchitectureError  # noqa: F401 (re-exported)

# MLP kinds the generic code knows. "gated": down(act(gate(x)) * up(x)) (SwiGLU, GeGLU);
# "fused_gated": the same with gate and up in one projection (phi3); "plain": down(act(up(x)));
# "moe": a router plus experts.
MLP_KINDS = ("gated", "fused_gated", "plain", "moe")

# What ``...ForCausalLM.forward`` may do to the logits after the output layer: "softcap": cap * tanh(z / cap)
# (Gemma 2); "multiply": z * value (Cohere's logit_scale); "divide": z / value (Granite's logits_scaling).
HEAD_OPS = ("softcap", "multiply", "divide")

# Config fields that change the logits in some transformers model's ``ForCausalLM.forward``, and how. A model
# whose config sets one of them (to a value that is not neutral) is refused unless its spec's ``head`` applies
# it: the fused head bypasses that forward, so an undeclared transform would be silently skipped.
HEAD_CONFIG_FIELDS: dict[str, str] = {
    "final_logit_softcapping": "softcap",
    "softcap": "softcap",
    "logit_scale": "multiply",
    "output_multiplier": "multiply",
    "logits_scaling": "divide",
}


@dataclass(frozen=True)
class HeadTransform:
    """One step ``ForCausalLM.forward`` applies to the logits after the output layer; value from the config."""

    op: str
    field: str

    def __post_init__(self) -> None:
        if self.op not in HEAD_OPS:
            raise ValueError(f"head transform op {self.op!r} is not one of {HEAD_OPS}")

    def is_neutral(self, value: Any) -> bool:
        """True when the config value leaves the logits unchanged (unset, a 0 softcap, a factor of 1)."""
        if value is None or isinstance(value, bool):
            return value is None or not value
        return value == 0 if self.op == "softcap" else value == 1


# How a Gated DeltaNet module projects its input (``LinearAttentionSpec.projections``). "separate": one linear
# per part, ``in_proj_qkv`` (q, k, v channels head-major, the conv's input), ``in_proj_z``, ``in_proj_b``,
# ``in_proj_a`` (Qwen3.5). "grouped": ``in_proj_qkvz`` and ``in_proj_ba`` with the parts interleaved per key
# head, ``[q_h, k_h, v_h..., z_h...]`` for each key head ``h`` (Qwen3-Next).
LINEAR_PROJECTIONS = ("separate", "grouped")


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The linear-attention (Gated DeltaNet) layers of a hybrid model.

    A layer is linear attention when ``config.<layer_types_field>[i] == layer_type``; its module is at
    ``module`` (relative to the layer) and reads ``linear_num_key_heads``, ``linear_num_value_heads``,
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim`` from the config. The other
    layers are full attention (``ArchSpec.attention``).
    """

    module: str = "linear_attn"
    layer_types_field: str = "layer_types"
    layer_type: str = "linear_attention"
    projections: str = "separate"

    def __post_init__(self) -> None:
        if self.projections not in LINEAR_PROJECTIONS:
            raise ValueError(f"linear attention projections {self.projections!r} is not one of {LINEAR_PROJECTIONS}")


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
    # What the model's forward does to the logits after the output layer, in order (``HeadTransform``s);
    # applied exactly by the fused head (``actorcore.hf.head``) and checked by ``verify``.
    head: tuple[HeadTransform, ...] = ()
    # Config fields that must be falsy/None for this spec to be valid, with the reason if they are not.
    unsupported_config: tuple[tuple[str, str], ...] = ()
    # Layers whose MLP kind differs (MoE models with dense layers): config-driven, resolved at use.
    notes: str = ""
    # Megatron-Core part (``McoreSpec``: conversion rules and config overrides, or ``refused=`` with the
    # reason). Required, and never shared with another spec: a derived spec states its own.
    mcore: Any = None
    # Vision-language part (vision tower, rope-index function, feature merging); filled for VLMs.
    vision: Any = None
    # Hybrid models: which layers are linear attention and how their module is laid out (``LinearAttentionSpec``);
    # None for models whose every layer is full attention.
    linear_attention: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(f"{self.model_type}: mlp_kind {self.mlp_kind!r} is not one of {MLP_KINDS}")
        if not isinstance(self.mcore, McoreSpec):
            raise ValueError(f"{self.model_type}: the spec must state its Megatron part: mcore=McoreSpec(rules=...) "
                             "or McoreSpec(refused='why this architecture has no Megatron route')")
        if self.linear_attention is not None and not isinstance(self.linear_attention, LinearAttentionSpec):
            raise ValueError(f"{self.model_type}: linear_attention must be a LinearAttentionSpec, got "
                             f"{type(self.linear_attention).__name__}")
        if not all(isinstance(t, HeadTransform) for t in self.head):
            raise ValueError(f"{self.model_type}: head must be a tuple of HeadTransform, got {self.head!r}")


def task_model(model: Any) -> Any:
    """The ``...ForCausalLM`` (or critic) the spec's paths start from: inside a PEFT wrapper (LoRA), its base
    model, whose layers hold the adapters."""
    if callable(getattr(type(model), "get_base_model", None)) and hasattr(model, "peft_config"):
        return model.get_base_model()
    return model


def submodule(root: Any, path: str) -> Any:
    """``root.get_submodule(path)`` for a path from a spec (from the task model inside a PEFT wrapper), with an
    error that names the missing step."""
    root = task_model(root)
    try:
        return root.get_submodule(path)
    except AttributeError as err:
        raise _missing_submodule(root, path, err) from None


def _missing_submodule(root: Any, path: str, err: AttributeError) -> Exception:
    """The error for a spec path the model does not have, by what is most likely wrong: a base model given where
    the task model is needed, a layer count edited after the model was built, or (only then) a layout change."""
    name = type(root).__name__
    prefix = getattr(root, "base_model_prefix", None)
    if prefix and path.split(".")[0] == prefix and getattr(root, "base_model", None) is root:
        return UnsupportedArchitectureError(
            f"{name} is a base model without the task head (no {prefix!r} inside it): actorcore needs the "
            f"...ForCausalLM (AutoModelForCausalLM.from_pretrained(...)) or, for values, the "
            "...ForTokenClassification critic")
    module, walked = root, []
    for part in path.split("."):
        if part.isdigit() and hasattr(module, "__len__"):
            if int(part) >= len(module):
                config = getattr(root, "config", None)
                text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
                return ValueError(
                    f"{name}.{'.'.join(walked)} has {len(module)} entries but actorcore looked for entry {part} "
                    f"(the config says num_hidden_layers={getattr(text, 'num_hidden_layers', None)}): the config "
                    "was changed after the model was built; build the model from the edited config (or restore "
                    "the field)")
            module = module[int(part)]
        elif getattr(module, part, None) is not None:
            module = getattr(module, part)
        else:
            break
        walked.append(part)
    return AttributeError(
        f"{name} has no submodule {path!r} (a path from actorcore's arch spec): {err}. The installed transformers "
        "lays this model out differently than the spec says: report it (the spec lives in actorcore/archs/)")
