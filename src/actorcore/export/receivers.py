"""Receivers of a weight stream (buckets of ``(hf_name, tensor)`` from ``hf_weight_stream``).

- ``load_into(model, stream)``: a plain transformers model in this process, checked name by name.
- ``load_into_vllm(model, stream)``: vLLM's model interface, ``model.load_weights(weights)`` where ``weights`` is an
  iterable of ``(name, tensor)`` and the return value is the set of names loaded (a model before its post-load
  processing; a running engine is updated through ``actorcore.engines.VllmBridge``).
- ``load_into_sglang(engine, stream)``: SGLang's ``Engine.update_weights_from_tensor(named_tensors, load_format=None,
  flush_cache=True)``, once per bucket with ``flush_cache=False``, then ``engine.flush_cache()``.

vLLM and SGLang are never imported here: the adapters only call those published methods on the object passed in.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from actorcore.export.stream import Bucket, exported_names, for_each_bucket

logger = logging.getLogger(__name__)


def load_into(model: torch.nn.Module, stream: Iterable[Bucket]) -> list[str]:
    """Copy every streamed tensor into the parameter or persistent buffer of that state-dict name; return the names.

    Refused with a ``ValueError`` naming them: a name the model does not have, a shape or dtype that differs from the
    model's tensor (cast the stream with ``dtype=`` instead), a name sent twice, two names that are one tied tensor
    in this model (the sender's model is untied: its tie structure differs), and, after the stream ends, names of
    the model that never came. Takes the model's state-dict names (``hf_weight_stream(..., names="model")``); a tied
    duplicate the stream leaves out is filled through its tie. Tensors are copied as they arrive: after an error the
    model holds a partial update, so reload it.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"load_into needs the receiving torch model (an nn.Module), got {type(model).__name__}; "
                         "for vLLM use load_into_vllm, for SGLang load_into_sglang")
    targets = model.state_dict(keep_vars=True)  # parameters and persistent buffers, tied ones under every name
    expected = exported_names(model, targets)
    tied: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        tied.setdefault(id(tensor), []).append(name)
    received: list[str] = []
    seen: dict[int, str] = {}  # id of a target tensor -> the name it was received under

    def load(bucket: Bucket) -> None:
        for name, tensor in bucket:
            target = targets.get(name)
            _check_one(model, name, tensor, target, seen.get(id(target)) if target is not None else None,
                       tied.get(id(target), []))
            target.copy_(tensor)
            seen[id(target)] = name
            received.append(name)

    with torch.no_grad():
        for_each_bucket(stream, load)
    arrived = set(received)
    missing = [n for n in expected if n not in arrived]
    if missing:
        raise ValueError(f"load_into: the stream ended without {len(missing)} of the model's tensors: {missing} "
                         "(did every rank iterate the whole stream? was it exported from another model, or from "
                         "one whose weights are tied where this one's are not?)")
    logger.info("loaded %d tensors into %s", len(received), type(model).__name__)
    return received


def _check_one(model: torch.nn.Module, name: str, tensor: torch.Tensor, target: torch.Tensor | None,
               earlier: str | None, tie_group: list[str]) -> None:
    if target is None:
        raise ValueError(f"load_into: the stream sent {name!r}, which {type(model).__name__} does not "
                         "have (a checkpoint name of a converted weight? stream with names='model'; "
                         "or another model's weights)")
    if earlier == name:
        raise ValueError(f"load_into: the stream sent {name!r} twice")
    if earlier is not None:
        raise ValueError(f"load_into: the stream sent both {earlier!r} and {name!r}, which are one tied tensor in "
                         f"{type(model).__name__} (tied: {tie_group}): the sending model is not tied there, so "
                         "its weights cannot be loaded without losing one of them; load into a model with the "
                         "sender's tie structure (the same tie_word_embeddings)")
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"load_into: {name!r} has shape {tuple(tensor.shape)} in the stream but "
                         f"{tuple(target.shape)} in the model (a different config?)")
    if tensor.dtype != target.dtype:
        raise ValueError(f"load_into: {name!r} is {tensor.dtype} in the stream but {target.dtype} in the "
                         "model: cast explicitly (hf_weight_stream(..., dtype=...) or model.to(dtype))")


def load_into_vllm(model: Any, stream: Iterable[Bucket]) -> set[str]:
    """Feed each bucket to vLLM's ``model.load_weights(weights)`` (the model's own loader maps checkpoint names to
    its fused parameters); return the union of the names it reports loaded.

    The low-level call, and only that: it does NOT run vLLM's reload protocol (after an engine has started, its
    layers hold post-processed weights: on vLLM's CPU build every linear is repacked and this call fails half-way,
    leaving some layers new and some old), does not rerun the post-processing an update needs (repacked or
    quantised linears, fused MoE experts, a tied lm-head's copy), does not reset the prefix cache, and verifies
    nothing. To update a running engine use ``actorcore.engines.VllmBridge``, which does all of that and raises
    when the engine does not compute with the sent weights.

    Use the default ``names="checkpoint"`` stream: vLLM loads checkpoint names.
    """
    if not callable(getattr(model, "load_weights", None)):
        raise ValueError(f"load_into_vllm needs vLLM's model object (with load_weights(weights)), got "
                         f"{type(model).__name__}: in vLLM it is llm.llm_engine.model_executor.driver_worker."
                         "model_runner.model (or a worker's self.model_runner.model)")
    loaded: set[str] = set()
    for_each_bucket(stream, lambda bucket: loaded.update(model.load_weights(iter(bucket)) or ()))
    return loaded


def load_into_sglang(engine: Any, stream: Iterable[Bucket], *, load_format: str | None = None) -> int:
    """Send each bucket with SGLang's ``engine.update_weights_from_tensor(named_tensors, load_format, flush_cache)``;
    then ``engine.flush_cache()`` once (the cache is stale only after the last bucket; holding a bucket back to
    flag the last one would double the memory bound). Returns the number of buckets sent.

    Use the default ``names="checkpoint"`` stream: SGLang loads checkpoint names.
    """
    if not all(callable(getattr(engine, m, None)) for m in ("update_weights_from_tensor", "flush_cache")):
        raise ValueError(f"load_into_sglang needs an SGLang engine (update_weights_from_tensor, flush_cache), got "
                         f"{type(engine).__name__}")
    sent = for_each_bucket(stream, lambda bucket: engine.update_weights_from_tensor(
        named_tensors=list(bucket), load_format=load_format, flush_cache=False))
    engine.flush_cache()
    return sent
