"""Rule geometry: how a rank's local Megatron parameters relate to the HF checkpoint's tensors.

Pure functions of a built model and its weight rules, shared by the load (``mcore.convert.load``) and the export
(``mcore.convert.weight_stream``): global names of local parameters (layer and expert indices), the full HF shapes of a
rule's parts, tied weights, and the MTP layers' copies of main-model tensors. No collectives, no file access.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from actorcore.archs.megatron_rules import SECTION_SIZES, McoreSpec, WeightRule
from actorcore.mcore.convert.transforms import local_experts, split_parts, tp_dim
from actorcore.parallel.context import ParallelContext

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def mcore_tensors(chunk: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The chunk's parameters and buffers by local name (Megatron's ``_extra_state`` left out)."""
    for name, tensor in chunk.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state"):
            yield name, tensor


def local_expert_index(local_name: str) -> int | None:
    """The local expert index in a parameter name (``...local_experts.{i}...``), None outside the experts."""
    found = _EXPERT.search(local_name)
    return None if found is None else int(found.group(1))


def with_local_expert(local_name: str, index: int) -> str:
    """The same parameter of local expert ``index``."""
    return _EXPERT.sub(f".local_experts.{index}.", local_name, count=1)


def global_mcore_name(chunk: Any, local_name: str, context: ParallelContext, mtp_layers: range = range(0)) -> str:
    """Local parameter name -> name with global layer and expert indices (what the rules match); an MTP layer's
    index is its HF index (``mtp_layers``: ``McoreModel.mtp_hf_layers``)."""
    found = _LAYER.match(local_name)
    if found:
        layer = chunk.decoder.layers[int(found.group(1))].layer_number - 1
        local_name = f"decoder.layers.{layer}." + local_name[found.end():]
    found = _MTP_LAYER.match(local_name)
    if found:
        index = chunk.mtp.layers[int(found.group(1))].layer_number - 1  # Megatron's global MTP index
        if index >= len(mtp_layers):
            raise ValueError(f"{local_name}: MTP layer {index} of a model with {len(mtp_layers)} (pass the model's "
                             "mtp_hf_layers)")
        local_name = f"mtp.layers.{mtp_layers[index]}." + local_name[found.end():]
    found = _EXPERT.search(local_name)
    if found:
        num_experts = chunk.config.num_moe_experts
        expert = local_experts(num_experts, context.ep_rank, context.ep_size)[int(found.group(1))]
        local_name = local_name[: found.start()] + f".local_experts.{expert}." + local_name[found.end():]
    return local_name


def head_counts(config: Any, tp_size: int) -> dict[str, int]:
    """This TP rank's query heads and query groups: what QKV merges and splits need."""
    return {"num_heads": config.num_attention_heads // tp_size, "num_query_groups": config.num_query_groups // tp_size}


def hf_part_shapes(rule: WeightRule, local_shape: torch.Size, config: Any, tp_size: int,
                   hf_vocab: int) -> list[tuple[int, ...]]:
    """Full HF shapes of a rule's parts, derived from this rank's parameter shape."""
    meta = torch.empty(local_shape, device="meta")
    parts = split_parts(rule.transform, meta, **head_counts(config, tp_size))
    shapes = []
    for part in parts:
        shape = list(part.shape)
        dim = tp_dim(rule.parallel)
        if rule.parallel == "vocab":
            shape[0] = hf_vocab
        elif dim is not None:
            shape[dim] *= tp_size
        shapes.append(tuple(shape))
    return shapes


def section_rows(rule: WeightRule, hf_config: Any) -> list[int]:
    """Full HF rows of each block of a sectioned rule (``WeightRule.sections``), from the HF config."""
    rows = []
    for name in rule.sections:
        heads, dim = SECTION_SIZES[name]
        rows.append(int(getattr(hf_config, heads)) * int(getattr(hf_config, dim)))
    return rows


def is_tied(rule: WeightRule, hf_config: Any) -> bool:
    """Whether the rule's HF tensor is the tied embedding (HF stores the tied head only as the embedding)."""
    return bool(rule.tied_hf_name and getattr(hf_config, "tie_word_embeddings", False))


def shared_copies(rules: McoreSpec, layers: range, hf_config: Any) -> dict[str, list[str]]:
    """{source HF name: [names of its copies in the MTP layers ``layers``]}, the source resolved through tied
    embeddings (a tied model stores its head only as the embedding)."""
    copies: dict[str, list[str]] = {}
    for layer in layers:
        for copy, source in rules.mtp.shared_names(layer):
            found = rules.rules_for_hf(source)
            if found and is_tied(found[0][0], hf_config):
                source = found[0][0].tied_hf_name
            copies.setdefault(source, []).append(copy)
    return copies
