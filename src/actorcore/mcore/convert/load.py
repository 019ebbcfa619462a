"""Load an HF safetensors checkpoint into a sharded Megatron model (``load_hf_into_mcore``).

Loading streams tensor by tensor: each rank opens the safetensors files lazily and reads, per parameter it
holds, only its slice of each HF tensor. Problems (missing, extra, mis-shaped tensors, another expert layout
than the model was built for) are collected on every rank and reported together in one
``CheckpointMismatchError``. The way back is ``mcore.convert.weight_stream``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from actorcore.archs.megatron_rules import McoreSpec, WeightRule
from actorcore.errors import CheckpointMismatchError
from actorcore.mcore.handle import GROUPED, PER_EXPERT, McoreModel, require_model
from actorcore.mcore.build.model import mcore_spec_for
from actorcore.mcore.convert.safetensors_reader import SafetensorsReader
from actorcore.mcore.convert.transforms import merge_parts, tp_dim, tp_range
from actorcore.mcore.convert.weight_layout import (global_mcore_name, head_counts, hf_part_shapes, is_tied, mcore_tensors,
                                           section_rows, shared_copies)
from actorcore.parallel import collectives
from actorcore.parallel.context import ParallelContext

logger = logging.getLogger(__name__)


def _expert_layout(checkpoint_rules: McoreSpec) -> str:
    return GROUPED if checkpoint_rules.uses_grouped_experts else PER_EXPERT


def checkpoint_expert_layout(hf_dir: str, hf_config: Any) -> str:
    """The expert layout the checkpoint in ``hf_dir`` stores (``build_gpt_model(..., expert_layout=)`` to load it)."""
    return _expert_layout(mcore_spec_for(hf_config).for_checkpoint(SafetensorsReader(hf_dir).names()))


def _checkpoint_rules(model: McoreModel, hf_names: set[str], hf_dir: str) -> McoreSpec:
    """The model's weight rules under the checkpoint's stored names; refuses another expert layout than built."""
    spec = model.spec.for_checkpoint(hf_names)
    found = _expert_layout(spec)
    if found != model.expert_layout:
        stored = "stacked per layer (experts.gate_up_proj)" if found == GROUPED else "one tensor per expert"
        raise CheckpointMismatchError(f"{hf_dir} stores the experts {stored}, but the model was built with "
                                      f"expert_layout={model.expert_layout!r}: build it with "
                                      f"build_gpt_model(..., expert_layout={found!r}) (checkpoint_expert_layout "
                                      "reads it from the directory)")
    return spec.with_mtp() if model.mtp_layers else spec


def _check_shared_copies(reader: SafetensorsReader, copies: dict[str, list[str]], consumed: set[str]) -> list[str]:
    """Each copy must equal its source bitwise (Megatron holds one tensor for both). Every rank compares its
    share of the rows, so the whole tensor is compared once, however large."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = []
    for source, names in copies.items():
        for name in names:
            if name not in reader:
                problems.append(f"missing tensor {name} (the MTP layer's copy of {source})")
                continue
            consumed.add(name)
            if source not in reader or reader.shape(name) != reader.shape(source):
                problems.append(f"tensor {name} has shape {list(reader.shape(name))}, its source {source} "
                                f"{list(reader.shape(source)) if source in reader else 'is missing'}")
                continue
            rows = reader.shape(name)[0]
            start, stop = rank * rows // world, (rank + 1) * rows // world
            if reader.dtype(name) != reader.dtype(source) or \
                    not torch.equal(reader.read(name, 0, start, stop), reader.read(source, 0, start, stop)):
                problems.append(f"tensor {name} differs from {source}: Megatron's MTP layers share the main "
                                "model's embedding and output layer, so the checkpoint's copy must equal it bitwise")
    return problems


def _mtp_tensors(spec: McoreSpec, names: set[str], hf_config: Any) -> list[str]:
    """The checkpoint's MTP tensors: those under the MTP head's own prefix (``MtpRules.hf_prefix``), and those the
    spec's MTP rules name in the MTP layers' HF indices (any other extra layer stays an error)."""
    if spec.mtp is None:
        return []
    layers = spec.mtp.hf_layers(hf_config.num_hidden_layers, spec.mtp.count(hf_config))
    rules = spec.mtp_layer_rules() + tuple(WeightRule(copy, (copy,)) for copy, _ in spec.mtp.shared)
    found = []
    for name in names:
        if spec.mtp.hf_prefix is not None and name.startswith(spec.mtp.hf_prefix):
            found.append(name)
        elif any((idx := rule.match_hf(name)) is not None and idx.get("layer") in layers for rule in rules):
            found.append(name)
    return sorted(found)


def _check_has_mtp_tensors(model: McoreModel, rules: McoreSpec, names: set[str], hf_dir: str) -> None:
    """A model built with MTP layers needs a checkpoint that has them: one holding no MTP tensor at all (a checkpoint
    that transformers saved again, say: it drops them on load) is refused with that reason, before anything is read.
    The same on every rank (a fact of the file names), so no rank waits on another."""
    if not model.mtp_layers or _mtp_tensors(rules, names, model.hf_config):
        return
    layer = model.mtp_hf_layers[0]
    expected = [n for rule in rules.mtp.rules for n in rule.hf_names_for({"layer": layer})]
    field, count = rules.mtp.count_field(model.hf_config)
    declared = f"{field}={count}" if getattr(model.hf_config, field, None) is not None else \
        f"{count}, the default where the config sets no {field}"
    raise CheckpointMismatchError(
        f"{hf_dir} holds no multi-token-prediction tensors (missing {', '.join(expected)} and the MTP decoder layer's "
        f"tensors), but the model was built with mtp=True (MTP layers: {declared}): the checkpoint was saved without "
        "them (transformers drops the MTP layers on load, so a checkpoint it saved again has none): build without "
        "mtp=True (drop --mtp), or load a checkpoint that still has them")


def _read_part(reader: SafetensorsReader, name: str, rule: WeightRule, context: ParallelContext,
               local_rows: int, indices: dict[str, int], sections: list[int]) -> torch.Tensor:
    if rule.grouped:
        return reader.read(name, 0, indices["expert"], indices["expert"] + 1)[0]
    dim = tp_dim(rule.parallel)
    if dim is None:
        return reader.read(name)
    if rule.parallel == "vocab":
        start = context.tp_rank * local_rows
        real = reader.shape(name)[0]
        rows = reader.read(name, 0, min(start, real), min(start + local_rows, real))
        if rows.shape[0] < local_rows:
            rows = torch.cat([rows, rows.new_zeros(local_rows - rows.shape[0], *rows.shape[1:])])
        return rows
    if sections:  # each block's slice, in block order
        parts, offset = [], 0
        for rows in sections:
            start, stop = tp_range(rows, context.tp_rank, context.tp_size)
            parts.append(reader.read(name, 0, offset + start, offset + stop))
            offset += rows
        return torch.cat(parts, dim=0)
    full = reader.shape(name)[dim]
    start, stop = tp_range(full, context.tp_rank, context.tp_size)
    return reader.read(name, dim, start, stop)


def _load_parameter(model: McoreModel, reader: SafetensorsReader, rules: McoreSpec, chunk: Any, local_name: str,
                    param: torch.Tensor, consumed: set[str]) -> list[str]:
    """Fill one local parameter from its HF tensors; returns the problems found (then it is left as it was)."""
    context, hf_config = model.context, model.hf_config
    name = global_mcore_name(chunk, local_name, context, model.mtp_hf_layers)
    try:
        rule, indices = rules.rule_for_mcore(name)
    except KeyError as exc:
        return [str(exc.args[0])]
    hf_names = rule.hf_names_for(indices, tied=is_tied(rule, hf_config))
    shapes = hf_part_shapes(rule, param.shape, chunk.config, context.tp_size, hf_config.vocab_size)
    if rule.grouped:
        shapes = [(chunk.config.num_moe_experts, *shape) for shape in shapes]
    problems, parts = [], []
    for hf_name, expected in zip(hf_names, shapes):
        if hf_name not in reader:
            problems.append(f"missing tensor {hf_name} (for Megatron {name})")
            continue
        consumed.add(hf_name)
        found = reader.shape(hf_name)
        if found != expected:
            problems.append(f"tensor {hf_name} has shape {list(found)}, expected {list(expected)}")
            continue
        parts.append(_read_part(reader, hf_name, rule, context, param.shape[0], indices,
                                section_rows(rule, hf_config)))
    if len(parts) == len(hf_names):
        local = merge_parts(rule.transform, parts, **head_counts(chunk.config, context.tp_size))
        with torch.no_grad():
            param.copy_(local)
    return problems


def load_hf_into_mcore(model: McoreModel, hf_dir: str, *, progress: bool = False) -> None:
    """Fill every parameter of this rank's model chunks from the HF checkpoint in ``hf_dir``.

    Collective over the world group (every rank must call it): the consumed tensor names are compared
    with the checkpoint so extra tensors are reported, and all ranks raise the same error.
    """
    model = require_model(model, "load_hf_into_mcore")
    hf_config = model.hf_config
    reader = SafetensorsReader(hf_dir)
    rules = _checkpoint_rules(model, reader.names(), hf_dir)
    _check_has_mtp_tensors(model, rules, reader.names(), hf_dir)
    problems: list[str] = []
    consumed: set[str] = set()
    items = [(chunk, name, tensor) for chunk in model.chunks for name, tensor in mcore_tensors(chunk)]
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="load HF -> Megatron", unit="tensor")
    for chunk, local_name, param in items:
        problems += _load_parameter(model, reader, rules, chunk, local_name, param, consumed)
    if model.mtp_layers:
        problems += _check_shared_copies(reader, shared_copies(rules, model.mtp_hf_layers, hf_config), consumed)
    everything = collectives.all_gather_object((sorted(consumed), problems), dist.group.WORLD)
    used = set().union(*(set(c) for c, _ in everything))
    problems = sorted(set(p for _, ps in everything for p in ps))
    extra = sorted(reader.names() - used)
    dropped = [] if model.mtp_layers else _mtp_tensors(rules, set(extra), hf_config)
    if dropped and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("%s: dropping the %d multi-token-prediction tensors (e.g. %s): the model is built without MTP "
                       "layers (build_gpt_model(..., mtp=True) or `convert hf-to-mcore --mtp` keeps them)", hf_dir,
                       len(dropped), dropped[0])
    extra = sorted(set(extra) - set(dropped))
    if extra:
        problems.append(f"unexpected tensors not used by the {hf_config.model_type} model: {', '.join(extra)}")
    if problems:
        raise CheckpointMismatchError(f"{hf_dir} does not match the {hf_config.model_type} model its config.json "
                                      "describes: the config and the weights disagree (was config.json edited, or "
                                      "is it another model's?): " + "; ".join(problems))
