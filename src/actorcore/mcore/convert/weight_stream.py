"""``mcore_weight_stream``: a Megatron model sharded over TP / PP / EP as buckets of HF checkpoint-named full
tensors, gathered one bucket at a time (the Megatron side of the weight sync to a rollout engine).

The buckets have the format of ``actorcore.export``'s streams (a list of ``(hf_name, tensor)``), so its receivers
take them as they are: ``save_sharded_safetensors``, ``broadcast_stream``, ``load_into``, the vLLM / SGLang adapters.

Every rank of the model receives the whole stream. Each HF tensor is made where it lives and then sent to the rest:
a TP-split part is all-gathered over the TP group (the ranks of a stage hold its shards), a per-expert tensor is
broadcast over the EP group from the rank that owns the expert, a grouped-experts tensor (``[E, ...]``) is
all-gathered over EP, and then the tensor is broadcast over the PP group from the stage that holds it. Ranks that
only take part (every rank but the one that writes or forwards the stream) iterate it and drop the buckets.

Planning needs only sizes: each stage lists its tensors' HF names, shapes and dtypes (one ``all_gather_object``
over the PP group), and every rank cuts the same list into the same buckets, so the collectives line up.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from actorcore.archs.megatron_rules import WeightRule
from actorcore.buckets import DEFAULT_BUCKET_BYTES, Bucket, plan_buckets
from actorcore.mcore.handle import McoreModel, require_model
from actorcore.mcore.convert.transforms import split_parts, tp_dim, unshard_sections
from actorcore.mcore.convert.weight_layout import (global_mcore_name, head_counts, hf_part_shapes, is_tied, local_expert_index,
                                           mcore_tensors, section_rows, shared_copies, with_local_expert)
from actorcore.parallel import collectives
from actorcore.parallel.context import ParallelContext
from actorcore.sizes import positive_size

logger = logging.getLogger(__name__)

_Meta = tuple[str, tuple[int, ...], torch.dtype]  # (hf_name, full shape, dtype): what the PP ranks exchange


@dataclass
class _Source:
    """How this stage makes one full HF tensor from its local parameters.

    ``kind``: ``tp`` (a part of one parameter, gathered over TP when split), ``expert`` (a part of one local
    expert's parameter, sent by the EP rank ``ep_owner``), ``grouped`` (a part of every local expert of a layer,
    stacked and gathered over EP into ``[E, ...]``).
    """

    kind: str
    tensors: list[torch.Tensor]
    part: int
    rule: WeightRule
    counts: dict[str, int]
    ep_owner: int = 0
    sections: list[int] | None = None  # full rows of each block of a sectioned rule
    copy: bool = False  # an MTP layer's copy of a main-model tensor: its own storage (writers refuse shared ones)


def _out_dtype(dtype: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    return target if target is not None and dtype.is_floating_point else dtype


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _local_part(tensor: torch.Tensor, source: _Source, dtype: torch.dtype | None) -> torch.Tensor:
    part = split_parts(source.rule.transform, tensor.detach(), **source.counts)[source.part]
    return part.to(_out_dtype(part.dtype, dtype)).contiguous()


def _stage_sources(model: McoreModel, dtype: torch.dtype | None) -> tuple[list[_Meta], list[_Source]]:
    """This stage's HF tensors, in the chunks' state-dict order: the same list on every rank of the stage."""
    hf_config, context = model.hf_config, model.context
    spec = model.weight_rules  # in the expert layout the model was built for
    # MTP: the checkpoint stores the shared embedding / head again under the MTP layer's names.
    copies = shared_copies(spec, model.mtp_hf_layers, hf_config) if model.mtp_layers else {}
    metas: list[_Meta] = []
    sources: list[_Source] = []

    def add(names: tuple[str, ...], shapes: list[tuple[int, ...]], out: torch.dtype, **source: Any) -> None:
        for part, (hf_name, shape) in enumerate(zip(names, shapes)):
            for name in [hf_name, *copies.get(hf_name, [])]:
                metas.append((name, tuple(shape), out))
                sources.append(_Source(part=part, copy=name != hf_name, **source))

    for chunk in model.chunks:
        counts = head_counts(chunk.config, context.tp_size)
        local = dict(mcore_tensors(chunk))
        for local_name, tensor in local.items():
            if local_name.startswith("embedding.") and not chunk.pre_process:
                continue  # the MTP stage's replica of the first stage's embedding
            rule, indices = spec.rule_for_mcore(global_mcore_name(chunk, local_name, context, model.mtp_hf_layers))
            if is_tied(rule, hf_config):
                continue  # HF stores the tied lm_head only as the embedding
            shapes = hf_part_shapes(rule, tensor.shape, chunk.config, context.tp_size, hf_config.vocab_size)
            out = _out_dtype(tensor.dtype, dtype)
            common = {"rule": rule, "counts": counts, "sections": section_rows(rule, hf_config)}
            if rule.parallel != "expert":
                add(rule.hf_names_for(indices), shapes, out, kind="tp", tensors=[tensor], **common)
                continue
            num_experts = chunk.config.num_moe_experts
            per_rank = num_experts // context.ep_size
            local_index = local_expert_index(local_name)
            if rule.grouped:
                if local_index == 0:  # one [E, ...] tensor per layer, made from all local experts at once
                    siblings = [local[with_local_expert(local_name, j)] for j in range(per_rank)]
                    add(rule.hf_names_for(indices), [(num_experts, *s) for s in shapes], out, kind="grouped",
                        tensors=siblings, **common)
                continue
            for owner in range(context.ep_size):  # local expert i of every EP rank, in EP-rank order
                names = rule.hf_names_for({**indices, "expert": owner * per_rank + local_index})
                add(names, shapes, out, kind="expert", tensors=[tensor], ep_owner=owner, **common)
    return metas, sources


def _make(source: _Source, meta: _Meta, context: ParallelContext, dtype: torch.dtype | None,
          hf_vocab: int) -> torch.Tensor:
    """The full tensor of ``meta`` on every rank of this stage (collectives over TP or EP)."""
    if source.kind == "grouped":
        stacked = torch.stack([_local_part(t, source, dtype) for t in source.tensors])
        return torch.cat(collectives.all_gather_tensor(stacked, context.ep_group), dim=0)
    if source.kind == "expert":
        if context.ep_size == 1:
            return _local_part(source.tensors[0], source, dtype)
        if context.ep_rank == source.ep_owner:
            tensor = _local_part(source.tensors[0], source, dtype)
        else:
            tensor = torch.empty(meta[1], dtype=meta[2], device=source.tensors[0].device)
        return collectives.broadcast_tensor(tensor, source.ep_owner, context.ep_group)
    part = _local_part(source.tensors[0], source, dtype)
    dim = tp_dim(source.rule.parallel)
    if dim is not None and context.tp_size > 1:
        shards = collectives.all_gather_tensor(part, context.tp_group)
        part = unshard_sections(shards, source.sections) if source.sections else torch.cat(shards, dim=dim)
    if source.rule.parallel == "vocab":
        part = part[:hf_vocab]  # drop the padded rows
    return part


def mcore_weight_stream(model: McoreModel, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Yield this rank's model (``build_gpt_model``'s ``McoreModel``) as buckets of ``(hf_name, full_tensor)``.

    - Collective over every rank of the model: each rank passes its own model and iterates the WHOLE stream, in
      step; every rank gets every tensor of the model (all stages, all experts). A rank that does not need the
      weights iterates and drops them (e.g. ``save_sharded_safetensors(..., write=False)``).
    - Names and layout are the HF checkpoint's, from the architecture's weight rules: QKV and gate/up split into
      their HF tensors, per-expert names (``...experts.{e}.gate_proj.weight``) where the checkpoint uses them, a
      grouped ``experts.gate_up_proj`` ``[E, 2I, D]`` when the model was built with ``expert_layout="grouped"``, no
      ``lm_head.weight`` when the embeddings are tied, the vocabulary without Megatron's padding.
    - Memory: a bucket's tensors add up to at most ``bucket_bytes`` (of the output dtype), unless one tensor alone
      is larger: it is then alone in its bucket. Only one bucket is made at a time (plus, while a TP-split tensor
      is gathered, its shards): drop your references to a bucket before asking for the next one.
    - dtype: ``None`` keeps the model's dtype (bitwise the weights); ``dtype=torch.bfloat16`` casts floating
      tensors (before the gather, so less is sent when it narrows them).
    - Tensors are fresh, except where a parameter already is the full tensor (no TP split, one pipeline stage):
      then it may be the model's own storage, so do not modify them.
    - Wrong arguments raise ``ValueError`` at the call, before any collective.
    """
    bucket_bytes = positive_size("bucket_bytes", bucket_bytes)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating torch.dtype (it applies to floating tensors), got {dtype}")
    return _stream(require_model(model, "mcore_weight_stream"), bucket_bytes, dtype)


def _stream(model: McoreModel, bucket_bytes: int, dtype: torch.dtype | None) -> Iterator[Bucket]:
    context, hf_vocab = model.context, model.hf_config.vocab_size
    device = next(p.device for chunk in model.chunks for p in chunk.parameters())
    metas, sources = _stage_sources(model, dtype)
    stages = collectives.all_gather_object(metas, context.pp_group)
    plan = [(stage, index) for stage, stage_metas in enumerate(stages) for index in range(len(stage_metas))]
    names = [stages[s][i][0] for s, i in plan]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"mcore_weight_stream: HF names {repeated} come from several Megatron parameters: the "
                         "architecture's weight rules map two parameters to one tensor")
    buckets = plan_buckets([(k, _nbytes(*stages[s][i][1:])) for k, (s, i) in enumerate(plan)], bucket_bytes)
    logger.info("exporting %d tensors in %d buckets of <= %d bytes", len(plan), len(buckets), bucket_bytes)
    for bucket_indices in buckets:
        bucket = _make_bucket([plan[k] for k in bucket_indices], stages, sources, context, dtype, hf_vocab, device)
        yield bucket
        del bucket  # nothing of a bucket is held here while the next one is made


def _make_bucket(entries: list[tuple[int, int]], stages: list[list[_Meta]], sources: list[_Source],
                 context: ParallelContext, dtype: torch.dtype | None, hf_vocab: int,
                 device: torch.device) -> Bucket:
    """One bucket's tensors (``(stage, index)`` entries of the plan), made by their stage and sent over PP."""
    bucket: Bucket = []
    for stage, index in entries:
        meta = stages[stage][index]
        if stage == context.pp_rank:
            tensor = _make(sources[index], meta, context, dtype, hf_vocab)
            if sources[index].copy:
                tensor = tensor.clone()
            if (tuple(tensor.shape), tensor.dtype) != meta[1:]:
                raise RuntimeError(f"mcore_weight_stream: {meta[0]} came out {tuple(tensor.shape)} {tensor.dtype}, "
                                   f"planned {meta[1]} {meta[2]} (a bug in the weight rules)")
        else:
            tensor = torch.empty(meta[1], dtype=meta[2], device=device)
        if context.pp_size > 1:
            tensor = collectives.broadcast_tensor(tensor, stage, context.pp_group)
        bucket.append((meta[0], tensor))
    return bucket


def export_mcore_to_hf(model: McoreModel, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's full HF-named tensors, one at a time, on every rank (all stages, gathered over TP / EP /
    PP): ``mcore_weight_stream`` with one tensor per bucket. Collective: every rank iterates it to the end."""
    for bucket in mcore_weight_stream(model, bucket_bytes=1, dtype=dtype):
        yield from bucket


def gather_hf_state_dict(model: McoreModel) -> dict[str, torch.Tensor]:
    """The whole model as HF-named tensors on every rank (gathered over TP, EP and pipeline stages)."""
    return dict(export_mcore_to_hf(model))
