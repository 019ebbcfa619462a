"""Receivers of a weight stream (buckets of ``(hf_name, tensor)`` from ``hf_weight_stream``).

- ``load_into(model, stream)``: a plain transformers model in this process, checked name by name.
- ``load_into_vllm(model, stream)``: vLLM's model interface, ``model.load_weights(weights)`` where ``weights`` is an
  iterable of ``(name, tensor)`` and the return value is the set of names loaded.
- ``load_into_sglang(engine, stream)``: SGLang's ``Engine.update_weights_from_tensor(named_tensors, load_format=None,
  flush_cache=True)``, once per bucket with ``flush_cache=False``, then ``engine.flush_cache()``.

vLLM and SGLang are never imported here: the adapters only call those published methods on the object passed in.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from actorcore.export.stream import Bucket, exported_names

logger = logging.getLogger(__name__)


def load_into(model: torch.nn.Module, stream: Iterable[Bucket]) -> list[str]:
    """Copy every streamed tensor into the parameter or persistent buffer of that state-dict name; return the names.

    Refused with a ``ValueError`` naming them: a name the model does not have, a shape or dtype that differs from the
    model's tensor (cast the stream with ``dtype=`` instead), a name sent twice, and, after the stream ends, names
    of the model that never came. Takes the model's state-dict names (``hf_weight_stream(..., names="model")``);
    a tied duplicate the stream leaves out is filled through its tie. Tensors are copied as they arrive: after an
    error the model holds a partial update, so reload it.
    """
    targets = model.state_dict(keep_vars=True)  # parameters and persistent buffers, tied ones under every name
    expected = exported_names(model, targets)
    received: list[str] = []
    seen: set[str] = set()
    with torch.no_grad():
        for bucket in stream:
            for name, tensor in bucket:
                target = targets.get(name)
                if target is None:
                    raise ValueError(f"load_into: the stream sent {name!r}, which {type(model).__name__} does not "
                                     "have (a checkpoint name of a converted weight? stream with names='model'; "
                                     "or another model's weights)")
                if name in seen:
                    raise ValueError(f"load_into: the stream sent {name!r} twice")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"load_into: {name!r} has shape {tuple(tensor.shape)} in the stream but "
                                     f"{tuple(target.shape)} in the model (a different config?)")
                if tensor.dtype != target.dtype:
                    raise ValueError(f"load_into: {name!r} is {tensor.dtype} in the stream but {target.dtype} in the "
                                     "model: cast explicitly (hf_weight_stream(..., dtype=...) or model.to(dtype))")
                target.copy_(tensor)
                seen.add(name)
                received.append(name)
    missing = [n for n in expected if n not in seen]
    if missing:
        raise ValueError(f"load_into: the stream ended without {len(missing)} of the model's tensors: {missing} "
                         "(did every rank iterate the whole stream? was it exported from another model?)")
    logger.info("loaded %d tensors into %s", len(received), type(model).__name__)
    return received


def load_into_vllm(model: Any, stream: Iterable[Bucket]) -> set[str]:
    """Feed each bucket to vLLM's ``model.load_weights(weights)`` (the model's own loader maps checkpoint names to
    its fused parameters); return the union of the names it reports loaded.

    Use the default ``names="checkpoint"`` stream: vLLM loads checkpoint names.
    """
    if not callable(getattr(model, "load_weights", None)):
        raise ValueError(f"load_into_vllm needs vLLM's model object (with load_weights(weights)), got "
                         f"{type(model).__name__}: in vLLM it is llm.llm_engine.model_executor.driver_worker."
                         "model_runner.model (or a worker's self.model_runner.model)")
    loaded: set[str] = set()
    for bucket in stream:
        result = model.load_weights(iter(bucket))
        loaded |= set(result or ())
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
    sent = 0
    for bucket in stream:
        engine.update_weights_from_tensor(named_tensors=list(bucket), load_format=load_format, flush_cache=False)
        sent += 1
    engine.flush_cache()
    return sent
