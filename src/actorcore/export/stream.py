"""``hf_weight_stream``: an HF model's weights as buckets of ``(hf_name, full_tensor)``, gathered one bucket at a time.

The model may be plain or sharded with FSDP2 (``fully_shard``: its parameters are ``DTensor``s, on any mesh).
Each bucket's sharded tensors are gathered (``DTensor.full_tensor()``, one all-gather per tensor) only when the
bucket is produced, so the extra memory at any time is one bucket, not the model. The order of the tensors is the
model's ``state_dict()`` order, which is the same on every rank (the module tree is the same).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable, Iterator

import torch

from actorcore.archs.spec import task_model
from actorcore.buckets import DEFAULT_BUCKET_BYTES, Bucket, plan_buckets
from actorcore.export.fp8 import (BlockwiseFP8, quantize_fp8_blockwise, quantized_model_names, quantized_nbytes,
                                  resolve_scheme, scale_name)
from actorcore.export.lora import LORA_MODES, Entry, adapter_state, is_peft_model, merge_lora, merged_entries
from actorcore.sizes import positive_size

logger = logging.getLogger(__name__)

NAME_KINDS = ("checkpoint", "model")


def _tied_weight_patterns(model: torch.nn.Module) -> list[str]:
    """Every module's ``_tied_weights_keys`` (a dict ``{tied: source}`` in transformers 5, a list before), prefixed
    with the module's path: the names ``save_pretrained`` may drop as duplicates."""
    patterns = []
    for path, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None) or {}
        patterns += [f"{path}.{k}" if path else k for k in (keys.keys() if isinstance(keys, dict) else keys)]
    return patterns


def exported_names(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> list[str]:
    """The state-dict names ``save_pretrained`` keeps, in ``state_dict()`` order: every name, except a tied
    duplicate (a name holding the same tensor object as another) declared in ``_tied_weights_keys``.

    ``state``: the model's ``state_dict(keep_vars=True)`` if the caller has it (one walk of the module tree per
    export; the walks were a measurable part of a sync). A group of tied names that the declared keys do not
    reduce to one is refused, as ``save_pretrained`` refuses it.
    """
    state = model.state_dict(keep_vars=True) if state is None else state
    by_object: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_object.setdefault(id(tensor), []).append(name)
    patterns = None
    dropped = set()
    for names in by_object.values():
        if len(names) < 2:
            continue
        patterns = _tied_weight_patterns(model) if patterns is None else patterns
        tied = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        drop = tied[: len(names) - 1]
        if len(names) - len(drop) > 1:
            raise ValueError(f"tensors {sorted(names)} are one tensor, but the model's _tied_weights_keys "
                             f"({patterns}) declare only {tied} as tied: the checkpoint could not name them. Tie them "
                             "through the config (tie_word_embeddings) or untie them before exporting")
        dropped.update(drop)
    if dropped:
        logger.debug("not exporting tied duplicates %s", sorted(dropped))
    return [n for n in state if n not in dropped]


def _out_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None, scheme: BlockwiseFP8 | None) -> int:
    """Bytes of the tensor as yielded (a ``DTensor``'s numel is its global one); FP8: weight plus scales."""
    if scheme is not None:
        return quantized_nbytes(tensor.shape, scheme.block_size)
    return tensor.numel() * torch.empty((), dtype=_out_dtype(tensor, dtype)).element_size()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    tensor = tensor.detach()
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device_mesh.size() == 1:  # one rank holds all of it: full_tensor would still run a collective
        local = tensor.to_local()
        if local.shape == tensor.shape:
            return local
    return tensor.full_tensor()


def hf_weight_stream(model: torch.nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     dtype: torch.dtype | None = None, names: str = "checkpoint",
                     quantize: str | BlockwiseFP8 | None = None, lora: str = "merged") -> Iterator[Bucket]:
    """Yield the model's weights as buckets (lists) of ``(hf_name, full_tensor)``.

    - Collective: when the model is sharded (FSDP2 ``DTensor`` parameters), EVERY rank of its mesh must iterate the
      whole stream, in step, because each bucket all-gathers its tensors. Every rank gets the same full tensors.
    - Memory: one bucket is gathered at a time. A bucket's bytes (of the yielded tensors) are at most
      ``bucket_bytes``, unless one tensor alone is larger: it is then alone in its bucket. With checkpoint names
      the bound is on the gathered (model) tensors: a fused MoE tensor larger than the bound is alone in its bucket
      as all of its per-expert checkpoint tensors (views of it). Drop your references to a bucket before asking for
      the next one, or the bound is yours to break.
    - Names: ``names="checkpoint"`` (default) gives what ``save_pretrained`` writes and what vLLM / SGLang load: the
      state-dict names minus tied duplicates (Gemma's ``lm_head.weight`` when the embeddings are tied), with
      transformers' weight conversions reverted per tensor (a transformers 5 MoE's fused ``experts.gate_up_proj``
      becomes the checkpoint's per-expert ``experts.{e}.gate_proj.weight`` / ``up_proj.weight``).
      ``names="model"`` gives the model's own state-dict names (minus tied duplicates), which ``load_into`` and
      ``load_state_dict`` take.
    - dtype: ``None`` yields the tensors as the model holds them; ``dtype=torch.bfloat16`` casts floating tensors
      (integer buffers are kept). Nothing is cast unless asked.
    - quantize: ``"fp8_blockwise"`` (or a ``BlockwiseFP8``) yields the weights an FP8 checkpoint quantizes (every
      ``nn.Linear`` weight and fused expert projections, not embeddings, lm_head, norms, router gates) as
      ``float8_e4m3fn`` plus a float32 ``<name>_scale_inv`` per 128x128 block (the DeepSeek-V3 / Qwen3 FP8 layout;
      see ``actorcore.export.fp8``), quantized from the model's own values; ``dtype`` applies to the others. The
      bucket bound counts FP8 bytes plus scales.
    - lora: for a PEFT (LoRA) model, ``"merged"`` (default) yields the plain model's weights with the active
      adapters merged (``W + scaling * B @ A`` in float32, cast back; the model is not modified), under the base
      model's names, as ``merge_and_unload()`` would give them; ``"adapters"`` yields only the adapter tensors
      under PEFT's saved names (``get_peft_model_state_dict``; ``names`` and ``quantize`` do not apply).
    - Tensors of an unsharded model are the model's own storage (detached, not copied): do not modify them.
    """
    if names not in NAME_KINDS:
        raise ValueError(f"names must be one of {NAME_KINDS}, got {names!r}")
    bucket_bytes = positive_size("bucket_bytes", bucket_bytes)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (it applies to floating tensors), got {dtype}")
    scheme = resolve_scheme(quantize)
    if scheme is not None and names != "checkpoint":
        raise ValueError("quantize gives the FP8 checkpoint layout (per-expert weights and scales), which has "
                         "checkpoint names only: stream with names='checkpoint'")
    if lora not in LORA_MODES:
        raise ValueError(f"lora must be one of {LORA_MODES}, got {lora!r}")
    peft = is_peft_model(model)
    if lora == "adapters":
        if not peft:
            raise ValueError(f"lora='adapters' needs a PEFT model; {type(model).__name__} has no adapters")
        if scheme is not None:
            raise ValueError("quantize applies to the model's weights, not to LoRA adapters: export the adapters "
                             "without quantize (or the merged weights with it)")
        yield from _adapter_stream(model, bucket_bytes, dtype)
        return
    tree = task_model(model)  # the plain transformers model (inside a PEFT wrapper: its base model with the adapters)
    state = tree.state_dict(keep_vars=True)  # once per stream: the (sharded) parameters themselves, nothing gathered
    order = exported_names(tree, state)
    entries = merged_entries(model, order) if peft else [Entry(n, n) for n in order]
    fp8 = quantized_model_names(tree, scheme, [e.source for e in entries]) if scheme is not None else set()
    plan = plan_buckets([(e.name, _nbytes(state[e.source], dtype, scheme if e.source in fp8 else None))
                         for e in entries], bucket_bytes)
    by_name = {e.name: e for e in entries}
    revert = _reverter(tree, {e.name: state[e.source] for e in entries}) if names == "checkpoint" else None
    logger.info("exporting %d tensors in %d buckets of <= %d bytes%s", len(entries), len(plan), bucket_bytes,
                f" ({len(fp8)} in blockwise FP8)" if fp8 else "")
    for bucket_names in plan:
        bucket: Bucket = []
        for name in bucket_names:
            entry = by_name[name]
            full = merge_lora(_full(state[entry.source]), [(_full(state[d.a_name]), _full(state[d.b_name]), d.scaling)
                                                           for d in entry.deltas])
            for out_name, tensor in (revert(name, full) if revert is not None else [(name, full)]):
                if entry.source in fp8:
                    weight, scale_inv = quantize_fp8_blockwise(tensor, scheme.block_size, name=out_name)
                    bucket += [(out_name, weight), (scale_name(out_name), scale_inv)]
                else:
                    bucket.append((out_name, tensor.to(_out_dtype(tensor, dtype))))
        yield bucket
        del bucket


def _adapter_stream(model: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None) -> Iterator[Bucket]:
    adapters = adapter_state(model)
    plan = plan_buckets([(n, _nbytes(t, dtype, None)) for n, t in adapters.items()], bucket_bytes)
    logger.info("exporting %d LoRA adapter tensors in %d buckets", len(adapters), len(plan))
    for bucket_names in plan:
        yield [(n, _full(adapters[n]).to(_out_dtype(adapters[n], dtype))) for n in bucket_names]


def _reverter(model: torch.nn.Module, state: dict[str, torch.Tensor]):
    """``(name, tensor) -> [(checkpoint_name, tensor), ...]`` through transformers' ``revert_weight_conversion``
    (the function ``save_pretrained`` uses), one tensor at a time.

    That call costs about a millisecond per tensor even when it changes nothing (it rebuilds the model's conversion
    mapping), which was most of an 8B model's export time. So one call on shape-only (meta) copies of the whole
    state dict finds the names it passes through unchanged (the very tensor object comes back under its own name);
    only the others are reverted per tensor.
    """
    from transformers.core_model_loading import revert_weight_conversion

    meta = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") for name, tensor in state.items()}
    reverted = revert_weight_conversion(model, dict(meta))
    unchanged = {name for name, tensor in meta.items() if reverted.get(name) is tensor}

    def revert(name: str, tensor: torch.Tensor) -> Bucket:
        if name in unchanged:
            return [(name, tensor)]
        try:
            out = revert_weight_conversion(model, {name: tensor})
        except Exception as exc:  # noqa: BLE001 - re-raised with what to do
            raise ValueError(f"transformers could not convert {name} back to its checkpoint name(s) on its own "
                             f"({exc}); this model's weight conversion needs several tensors at once, which the "
                             "stream does not do yet: export with names='model'") from exc
        return list(out.items())

    return revert


def for_each_bucket(stream: Iterable[Bucket], load: Callable[[Bucket], Any]) -> int:
    """``load(bucket)`` for every bucket, holding no reference to one when the next is asked for (a ``for`` loop's
    variable would): a transport that lends its memory (``ipc_receive``) then reuses a released bucket's buffer
    instead of retiring it. Returns the number of buckets."""
    iterator = iter(stream)
    count = 0
    while True:
        bucket = next(iterator, None)
        if bucket is None:
            return count
        load(bucket)
        del bucket
        count += 1


def iter_tensors(stream: Iterable[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a stream of buckets, in order."""
    for bucket in stream:
        yield from bucket
