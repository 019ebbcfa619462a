"""Load HF safetensors into a sharded Megatron model and export it back as HF-named full tensors.

Loading streams tensor by tensor: each rank opens the safetensors files lazily and reads, per parameter it
holds, only its slice of each HF tensor (``safe_open(...).get_slice``). Problems (missing, extra,
mis-shaped tensors) are collected on every rank and reported together in one ``CheckpointMismatchError``.
Export (``mcore.weight_stream``) splits each local parameter into its HF parts and gathers them over TP / EP / PP
into full HF tensors, in buckets (with ``export_mcore_to_hf`` and ``gather_hf_state_dict``, its one-tensor and
whole-model forms).
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Iterator

import torch
import torch.distributed as dist

from actorcore.mcore.model import mcore_spec_for
from actorcore.parallel import collectives
from actorcore.parallel.context import ParallelContext
from actorcore.archs.megatron_rules import McoreSpec, WeightRule
from actorcore.mcore.transforms import local_experts, merge_parts, split_parts, tp_dim, tp_range
from actorcore.errors import CheckpointError, CheckpointMismatchError  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


# ---- reading --------------------------------------------------------------------------------------


class SafetensorsReader:
    """Lazy, sliced access to the tensors of an HF checkpoint directory (single file or sharded index)."""

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open

        from actorcore.model_files import index_files, model_file

        self.directory = directory
        index_path = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        self._files: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}
        if os.path.lexists(index_path):
            files = index_files(directory, "model.safetensors.index.json")  # every name checked: inside directory
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.lexists(single):
            files, weight_map = ["model.safetensors"], None
        else:
            raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")
        for name in files:
            path = model_file(directory, name)
            try:
                handle = safe_open(path, framework="pt")
                keys = list(handle.keys())
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types for damaged files
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
            self._files[name] = handle
            for key in keys:
                if weight_map is not None and weight_map.get(key) != name:
                    continue
                self.file_of[key] = name
        if weight_map is not None:
            absent = sorted(k for k, v in weight_map.items() if self.file_of.get(k) != v)
            if absent:
                raise CheckpointError(f"{directory}: tensors listed in the index are not in their files: "
                                      f"{', '.join(absent[:10])}")

    def names(self) -> set[str]:
        return set(self.file_of)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def _slice(self, name: str):
        return self._files[self.file_of[name]].get_slice(name)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype stored in the file's header (nothing is read)."""
        code = self._slice(name).get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.directory}: tensor {name} has dtype {code}, which Megatron weights "
                                  "cannot hold")
        return _SAFETENSORS_DTYPES[code]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor, or rows/columns ``[start, stop)`` of ``dim`` (only that part is read)."""
        try:
            part = self._slice(name)
            if dim is None:
                return part[:]
            index = (slice(None),) * dim + (slice(start, stop),)
            return part[index]
        except Exception as exc:  # noqa: BLE001 - truncated data surfaces here
            raise CheckpointError(f"{os.path.join(self.directory, self.file_of[name])}: cannot read {name} ({exc})") from None


def safetensors_dtype(hf_dir: str) -> torch.dtype:
    """The one dtype of an HF checkpoint's tensors, from the safetensors headers.

    Conversion builds the Megatron model in this dtype, not in the one ``config.json`` declares: a model
    saved in float32 with a config saying bfloat16 must come back float32, bit for bit.
    """
    reader = SafetensorsReader(hf_dir)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in sorted(reader.names()):
        by_dtype.setdefault(reader.dtype(name), []).append(name)
    if len(by_dtype) > 1:
        found = ", ".join(f"{len(names)} in {dtype} (e.g. {names[0]})" for dtype, names in by_dtype.items())
        raise CheckpointError(f"{hf_dir}: the tensors have several dtypes ({found}); a Megatron model holds one: "
                              "cast the checkpoint to one dtype first")
    if not by_dtype:
        raise CheckpointError(f"{hf_dir}: the checkpoint holds no tensors")
    return next(iter(by_dtype))


# ---- names and shapes ------------------------------------------------------------------------------


def _tensors(chunk: Any) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in chunk.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state"):
            yield name, tensor


def global_mcore_name(chunk: Any, local_name: str, context: ParallelContext) -> str:
    """Local parameter name -> name with global layer and expert indices (what the rules match)."""
    found = _LAYER.match(local_name)
    if found:
        layer = chunk.decoder.layers[int(found.group(1))].layer_number - 1
        local_name = f"decoder.layers.{layer}." + local_name[found.end():]
    found = _MTP_LAYER.match(local_name)
    if found:  # MTP layer i is the checkpoint's layer num_hidden_layers + i
        layer = chunk.config.num_layers + chunk.mtp.layers[int(found.group(1))].layer_number - 1
        local_name = f"mtp.layers.{layer}." + local_name[found.end():]
    found = _EXPERT.search(local_name)
    if found:
        num_experts = chunk.config.num_moe_experts
        expert = local_experts(num_experts, context.ep_rank, context.ep_size)[int(found.group(1))]
        local_name = local_name[: found.start()] + f".local_experts.{expert}." + local_name[found.end():]
    return local_name


def _head_counts(config: Any, tp_size: int) -> dict[str, int]:
    return {"num_heads": config.num_attention_heads // tp_size, "num_query_groups": config.num_query_groups // tp_size}


def _hf_part_shapes(rule: WeightRule, local_shape: torch.Size, config: Any, tp_size: int,
                    hf_vocab: int) -> list[tuple[int, ...]]:
    """Full HF shapes of a rule's parts, derived from this rank's parameter shape."""
    meta = torch.empty(local_shape, device="meta")
    parts = split_parts(rule.transform, meta, **_head_counts(config, tp_size))
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


def _is_tied(rule: WeightRule, hf_config: Any) -> bool:
    return bool(rule.tied_hf_name and getattr(hf_config, "tie_word_embeddings", False))


# ---- multi-token prediction -------------------------------------------------------------------------


def model_spec(chunk: Any, hf_names: set[str] | None = None) -> McoreSpec:
    """The weight rules of a built model: the expert layout of ``hf_names`` (the checkpoint being loaded) or
    the one it was loaded from, plus the MTP rules when it has MTP layers."""
    spec = mcore_spec_for(chunk.actorcore_hf_config)
    if hf_names is not None:
        spec = spec.for_checkpoint(hf_names)
    elif getattr(chunk, "actorcore_grouped_experts", False):
        spec = spec.with_grouped_experts()  # the layout the checkpoint was loaded from
    return spec.with_mtp() if chunk.config.mtp_num_layers else spec


def mtp_hf_layers(chunk: Any) -> range:
    """HF layer indices of the model's MTP layers (``num_hidden_layers + i``); empty without MTP."""
    return range(chunk.config.num_layers, chunk.config.num_layers + (chunk.config.mtp_num_layers or 0))


def shared_copies(spec: McoreSpec, chunk: Any) -> dict[str, list[str]]:
    """{source HF name: [names of its MTP copies]}, the source resolved through tied embeddings (a tied model
    stores its head only as the embedding)."""
    copies: dict[str, list[str]] = {}
    for layer in mtp_hf_layers(chunk):
        for copy, source in spec.mtp.shared_names(layer):
            rules = spec.rules_for_hf(source)
            if rules and _is_tied(rules[0][0], chunk.actorcore_hf_config):
                source = rules[0][0].tied_hf_name
            copies.setdefault(source, []).append(copy)
    return copies


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
    """The checkpoint's MTP tensors: named by the spec's MTP rules, in the layers ``num_hidden_layers + i`` for
    ``i < num_nextn_predict_layers`` (any other extra layer stays an error)."""
    layers = range(hf_config.num_hidden_layers,
                   hf_config.num_hidden_layers + (getattr(hf_config, "num_nextn_predict_layers", 0) or 0))
    if spec.mtp is None or not layers:
        return []
    with_mtp = spec.with_mtp()
    copies = [WeightRule(copy, (copy,)) for copy, _ in spec.mtp.shared]
    found = []
    for name in names:
        hits = [idx for _, idx in with_mtp.rules_for_hf(name)]
        hits += [idx for copy in copies if (idx := copy.match_hf(name)) is not None]
        if any(idx.get("layer") in layers for idx in hits):
            found.append(name)
    return sorted(found)


# ---- load ------------------------------------------------------------------------------------------


def _read_part(reader: SafetensorsReader, name: str, rule: WeightRule, context: ParallelContext,
               local_rows: int, indices: dict[str, int]) -> torch.Tensor:
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
    full = reader.shape(name)[dim]
    start, stop = tp_range(full, context.tp_rank, context.tp_size)
    return reader.read(name, dim, start, stop)


def load_hf_into_mcore(chunks: list[Any], hf_dir: str, context: ParallelContext, *, progress: bool = False) -> None:
    """Fill every parameter of this rank's model chunks from the HF checkpoint in ``hf_dir``.

    Collective over the world group (every rank must call it): the consumed tensor names are compared
    with the checkpoint so extra tensors are reported, and all ranks raise the same error.
    """
    hf_config = chunks[0].actorcore_hf_config
    reader = SafetensorsReader(hf_dir)
    spec = model_spec(chunks[0], reader.names())
    for chunk in chunks:  # export writes the experts back in the layout they came in
        chunk.actorcore_grouped_experts = spec.uses_grouped_experts
    problems: list[str] = []
    consumed: set[str] = set()
    items = [(chunk, name, tensor) for chunk in chunks for name, tensor in _tensors(chunk)]
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="load HF -> Megatron", unit="tensor")
    for chunk, local_name, param in items:
        name = global_mcore_name(chunk, local_name, context)
        try:
            rule, indices = spec.rule_for_mcore(name)
        except KeyError as exc:
            problems.append(str(exc.args[0]))
            continue
        hf_names = rule.hf_names_for(indices, tied=_is_tied(rule, hf_config))
        shapes = _hf_part_shapes(rule, param.shape, chunk.config, context.tp_size, hf_config.vocab_size)
        if rule.grouped:
            shapes = [(chunk.config.num_moe_experts, *shape) for shape in shapes]
        parts = []
        for hf_name, expected in zip(hf_names, shapes):
            if hf_name not in reader:
                problems.append(f"missing tensor {hf_name} (for Megatron {name})")
                continue
            consumed.add(hf_name)
            found = reader.shape(hf_name)
            if found != expected:
                problems.append(f"tensor {hf_name} has shape {list(found)}, expected {list(expected)}")
                continue
            parts.append(_read_part(reader, hf_name, rule, context, param.shape[0], indices))
        if len(parts) != len(hf_names):
            continue
        local = merge_parts(rule.transform, parts, **_head_counts(chunk.config, context.tp_size))
        with torch.no_grad():
            param.copy_(local)
    if chunks[0].config.mtp_num_layers:
        problems += _check_shared_copies(reader, shared_copies(spec, chunks[0]), consumed)
    everything = collectives.all_gather_object((sorted(consumed), problems), dist.group.WORLD)
    used = set().union(*(set(c) for c, _ in everything))
    problems = sorted(set(p for _, ps in everything for p in ps))
    extra = sorted(reader.names() - used)
    dropped = [] if chunks[0].config.mtp_num_layers else _mtp_tensors(spec, set(extra), hf_config)
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


# ---- export ----------------------------------------------------------------------------------------


def save_hf_checkpoint(state_dict: dict[str, torch.Tensor], hf_config: Any, out_dir: str) -> None:
    """Write ``model.safetensors`` + ``config.json`` into an existing directory (callers make it atomic)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sorted(state_dict.items())}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    hf_config.save_pretrained(out_dir)
