"""LoRA (PEFT) models in the weight stream: merged weights under the base model's names, or the adapters alone.

Merged: each LoRA-wrapped ``nn.Linear`` ``x`` (state-dict names ``x.base_layer.weight``, ``x.lora_A.<adapter>.weight``,
``x.lora_B.<adapter>.weight``) is exported as ``x.weight = W + sum_a scaling_a * (B_a @ A_a)`` over the active
adapters not merged yet, computed in float32 from the full (gathered) tensors and cast back to ``W``'s dtype once;
the model is not modified. The names are then the plain model's (``merge_and_unload``'s), and the rest of the stream
(tied duplicates, checkpoint names, casts, FP8) runs as for a plain model. Variants whose merge is not that formula
(DoRA, LoRA on embeddings or convolutions, ``lora_bias``, ``modules_to_save``) are refused with a ``ValueError``.

Adapters only: the tensors of PEFT's ``get_peft_model_state_dict`` under its names (what ``save_pretrained`` of a
PEFT model writes and what vLLM / SGLang LoRA loaders read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from actorcore.archs.spec import task_model
from actorcore.kernels.precision import autocast_disabled

LORA_MODES = ("merged", "adapters")
_UNSUPPORTED_WRAPPERS = (".modules_to_save.", ".original_module.", ".trainable_tokens_delta", ".token_adapter.")


def is_peft_model(model: Any) -> bool:
    return task_model(model) is not model


@dataclass(frozen=True)
class LoraDelta:
    """One adapter's low-rank update of a weight: ``scaling * (B @ A)``, from these state-dict names."""

    a_name: str
    b_name: str
    scaling: float


@dataclass(frozen=True)
class Entry:
    """One exported tensor: its name in the plain model (``name``), the state-dict name it is read from
    (``source``) and the LoRA updates to merge into it."""

    name: str
    source: str
    deltas: tuple[LoraDelta, ...] = field(default_factory=tuple)


def _lora_layers(base: torch.nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    layers = {}
    for path, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module.get_base_layer(), torch.nn.Linear):
            raise ValueError(f"{path}: LoRA on a {type(module.get_base_layer()).__name__} (only nn.Linear is merged "
                             "by the stream); leave it out of target_modules, or export lora='adapters'")
        for adapter in module.active_adapters:
            if adapter in module.lora_magnitude_vector or module.use_dora.get(adapter, False):
                raise ValueError(f"{path}: adapter {adapter!r} is DoRA, whose merge is not W + scaling * B @ A: "
                                 "export lora='adapters'")
            if module.lora_bias.get(adapter, False):
                raise ValueError(f"{path}: adapter {adapter!r} has lora_bias, which the stream does not merge: "
                                 "export lora='adapters'")
            if adapter in module.lora_embedding_A:
                raise ValueError(f"{path}: adapter {adapter!r} is a LoRA on embeddings: export lora='adapters'")
        if getattr(module, "fan_in_fan_out", False):
            raise ValueError(f"{path}: fan_in_fan_out LoRA (Conv1D weights) is not merged by the stream: export "
                             "lora='adapters'")
        layers[path] = module
    return layers


def merged_entries(model: Any, names: list[str]) -> list[Entry]:
    """The plain model's tensors of a PEFT model (``names``: the base model's exported state-dict names), each with
    the LoRA updates to merge into it."""
    base = task_model(model)
    layers = _lora_layers(base)
    entries = []
    for name in names:
        wrapper = next((w for w in _UNSUPPORTED_WRAPPERS if w in name), None)
        if wrapper is not None:
            raise ValueError(f"{name}: the PEFT model holds a {wrapper.strip('.')} wrapper (modules_to_save or "
                             "trainable tokens), which the merged stream does not unwrap: export lora='adapters'")
        path, base_layer, attr = name.rpartition(".base_layer.")
        if not base_layer:  # not a LoRA layer's base weight: an adapter tensor (dropped) or a plain tensor (kept)
            if any(name.startswith(f"{p}.lora_") for p in layers):
                continue
            entries.append(Entry(name, name))
            continue
        layer = layers.get(path)
        if layer is None:
            raise ValueError(f"{name}: a base_layer outside every LoRA layer PEFT knows of")
        deltas = ()
        if attr == "weight":
            deltas = tuple(LoraDelta(f"{path}.lora_A.{a}.weight", f"{path}.lora_B.{a}.weight", float(layer.scaling[a]))
                           for a in layer.active_adapters if a in layer.lora_A and a not in layer.merged_adapters)
        entries.append(Entry(f"{path}.{attr}", name, deltas))
    return entries


def merge_lora(weight: torch.Tensor, updates: list[tuple[torch.Tensor, torch.Tensor, float]]) -> torch.Tensor:
    """``W + sum scaling * (B @ A)`` in float32, cast back to ``W``'s dtype (a new tensor; ``weight`` is untouched)."""
    if not updates:
        return weight
    with autocast_disabled(weight.device):  # under a caller's autocast, B @ A would run in bf16
        merged = weight.float()
        for a, b, scaling in updates:
            merged = merged + (b.float() @ a.float()) * scaling
        return merged.to(weight.dtype)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """PEFT's own adapter state dict (``get_peft_model_state_dict``) of the active adapter: its tensors are the
    model's (sharded ones stay ``DTensor``s, gathered by the stream)."""
    from peft import get_peft_model_state_dict

    adapter = model.active_adapter
    if not isinstance(adapter, str):
        raise ValueError(f"lora='adapters' exports one adapter, but {list(adapter)} are active: set_adapter(name) "
                         "first")
    return get_peft_model_state_dict(model, adapter_name=adapter)
