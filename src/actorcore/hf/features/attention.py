"""Packed attention for Hugging Face models, through ``transformers``' official extension points.

``actorcore_packed`` is registered in ``AttentionInterface`` (and a no-mask function in
``AttentionMaskInterface``, since packing is described by ``cu_seq_lens_*`` kwargs, not by a mask).
Registration happens on first use, never on import. A model is switched to it per instance, for the
duration of a call (``packed_attention``), by setting ``_attn_implementation`` on the configs its attention
modules read, and restoring them afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator

import torch

from actorcore.errors import PackingNotAppliedError  # noqa: F401 (re-exported)
from actorcore.hf.call import TRACE_KWARG
from actorcore.hf.features.base import switched_for_call
from actorcore.kernels.attention.varlen import (TRACED_OP_NAMES, traceable_backend, varlen_causal_attention,
                                               varlen_causal_attention_traced)

logger = logging.getLogger(__name__)

PACKED_ATTENTION = "actorcore_packed"
# A keyword argument of the decoder call: the attention backend the patch asks for (``patch_model(attention_backend=)``;
# absent: "auto"), read by the attention functions below.
ATTENTION_BACKEND_KWARG = "actorcore_attention_backend"

def trace_key(implementation: str) -> str:
    return f"attention:{implementation}"


def record_call(kwargs: dict[str, Any], implementation: str) -> None:
    ref = kwargs.get(TRACE_KWARG)
    if ref is not None:
        ref.counts[trace_key(implementation)] += 1


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Packed attention needs no mask tensor: ``cu_seq_lens_*`` describe the sequences."""
    return None


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function: q/k/v ``[1, heads, T, H]`` -> ``([1, T, N, H], None)``.

    Inside a layer the compiled decoder compiles (it passes ``IN_GRAPH_KWARG``) the attention is traced into the
    layer's graph where its backend allows (``in_graph_attention``); everywhere else (eager calls, a user's own
    ``torch.compile``) it runs outside any graph and counts itself in the call's trace."""
    args = (module, query, key, value, scaling, dropout, sliding_window, softcap, kwargs)
    if kwargs.get(IN_GRAPH_KWARG) and torch.compiler.is_compiling():
        out = in_graph_attention(*args)
        if out is not None:
            return out, None
    return _attention_outside_graph(*args), None


# A keyword argument the compiled decoder passes to its compiled layers: trace the attention into the layer's graph.
IN_GRAPH_KWARG = "actorcore_attention_in_graph"


def in_graph_attention(module, query, key, value, scaling, dropout, sliding_window, softcap,
                       kwargs) -> torch.Tensor | None:
    """The packed attention as traced ops of a compiled layer (``[1, T, N, H]``), or None where its backend is not
    traceable (``traceable_backend``: torch's varlen op or FA4's; dropout in training, sinks or softcap outside FA4:
    the call then leaves the graph as before). Not counted here: the compiled decoder counts the layers whose compiled
    graphs hold it (``graph_attention_backends``)."""
    if module.training and dropout:
        return None
    sinks = attention_sinks(kwargs)
    head_dim = module_head_dim(module)  # a number of the module, a constant of the graph (the sizes are symbolic)
    # ``is not None``, not ``bool()``: a layer class whose layers alternate windows (gpt-oss) has its window traced as a
    # symbolic int, whose truth value is symbolic too, and the backend choice must be a constant of the graph
    backend = traceable_backend(query.device.type, query.dtype, kwargs.get(ATTENTION_BACKEND_KWARG, "auto"),
                                head_dim or 0, softcap is not None, sinks is not None, sliding_window is not None)
    if not backend or query.shape[0] != 1:
        return None
    if backend == "fa4":  # chosen for the module's head dim: the tensors must have it
        torch._check(max(query.shape[-1], value.shape[-1]) == head_dim)
    cu_seqlens, max_seqlen = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_seqlens is None or max_seqlen is None or (cu_k is not None and cu_k is not cu_seqlens):
        return None  # left to the checks of the eager path
    q_TNH, k_TKH, v_TKH = (x[0].transpose(0, 1) for x in (query, key, value))
    out_TNH = varlen_causal_attention_traced(q_TNH, k_TKH, v_TKH, cu_seqlens, max_seqlen, scale=scaling,
                                             sliding_window=sliding_window, softcap=softcap, sinks=sinks,
                                             backend=backend)
    return out_TNH.unsqueeze(0)


def module_head_dim(module: torch.nn.Module) -> int | None:
    """The one head dim a flash kernel sees for this attention module (the larger of its query/key and value head
    dims), from the module's attributes (``head_dim``; multi-head latent attention's ``qk_head_dim`` and
    ``v_head_dim``); None where it has none. Read off the module rather than the tensors: inside a compiled layer the
    tensors' sizes are symbolic."""
    dims = [getattr(module, name, None) for name in ("head_dim", "qk_head_dim", "v_head_dim")]
    dims = [d for d in dims if isinstance(d, int) and not isinstance(d, bool)]
    return max(dims) if dims else None


def graph_attention_backends(graph: torch.fx.Graph) -> set[str]:
    """The backends whose packed-attention ops a graph Dynamo captured calls (``varlen_causal_attention_traced``)."""
    return {backend for node in graph.nodes if node.op == "call_function"
            for name, backend in TRACED_OP_NAMES.items() if name in str(node.target)}


def holds_packed_attention(graph: torch.fx.Graph) -> bool:
    """Whether a graph Dynamo captured calls the packed attention's op (``varlen_causal_attention_traced``)."""
    return bool(graph_attention_backends(graph))


@torch.compiler.disable
def _attention_outside_graph(module, query, key, value, scaling, dropout, sliding_window, softcap,
                             kwargs) -> torch.Tensor:
    """Left out of a compiled graph: it reads per-call kwargs on the host and counts itself in the call's trace."""
    record_call(kwargs, PACKED_ATTENTION)
    cu_seqlens, max_seqlen = packing_kwargs(kwargs)
    out_TNH = attend_packed(query, key, value, cu_seqlens, max_seqlen, scaling=scaling, dropout=dropout,
                            sliding_window=sliding_window, softcap=softcap, sinks=attention_sinks(kwargs),
                            module=module, kwargs=kwargs)
    return out_TNH.unsqueeze(0)


def packing_kwargs(kwargs: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Read the explicit packing metadata; refuse to guess it."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q = kwargs.get("max_length_q")
    if cu_q is None or max_q is None:
        raise PackingNotAppliedError(
            "actorcore packed attention was called without cu_seq_lens_q / max_length_q; call the model through "
            "actorcore.compute_logprobs / compute_values (or pass the packing kwargs explicitly)"
        )
    if cu_k is not None and cu_k is not cu_q and not torch.equal(cu_k, cu_q):
        raise ValueError("packed attention needs cu_seq_lens_k == cu_seq_lens_q (no KV cache in training)")
    return cu_q, int(max_q)


def attention_sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The per-head sink logits a module passes to the attention interface (gpt-oss: ``s_aux``), if any."""
    sinks = kwargs.get("s_aux")
    return kwargs.get("sinks") if sinks is None else sinks


def attend_packed(query, key, value, cu_seqlens, max_seqlen, *, scaling, dropout, sliding_window, softcap,
                  sinks, module, kwargs) -> torch.Tensor:
    """Shared by the plain and the sequence-parallel attention: ``[1, heads, T, H]`` inputs -> ``[T, N, H]``."""
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1 (all sequences packed), got {query.shape[0]}")
    q_TNH = query[0].transpose(0, 1)
    k_TKH = key[0].transpose(0, 1)
    v_TKH = value[0].transpose(0, 1)
    p = dropout if module.training else 0.0
    ref = kwargs.get(TRACE_KWARG)
    return varlen_causal_attention(q_TNH, k_TKH, v_TKH, cu_seqlens, max_seqlen, scale=scaling,
                                   sliding_window=sliding_window, softcap=softcap, dropout=p, sinks=sinks,
                                   backend=kwargs.get(ATTENTION_BACKEND_KWARG, "auto"),
                                   trace=None if ref is None else ref.counts)


# The transformers versions the HF route is tested with (5.17 on the GPU machine, 5.24 on the CPU); below
# 5.10 the VLM inputs fail (5.0: mm_token_type_ids; 5.5: the rope-index function).
TRANSFORMERS_RANGE = ((5, 10), (6, 0))


def check_transformers_version(version: str) -> None:
    """Refuse a transformers outside the tested range with what to install, instead of failing deep inside."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = TRANSFORMERS_RANGE
    if len(parts) < 2 or not low <= parts < high:
        raise ImportError(f"actorcore's HF route needs transformers>={low[0]}.{low[1]},<{high[0]} (tested with 5.17 "
                          f"and 5.24); found {version}: pip install 'transformers>={low[0]}.{low[1]},<{high[0]}'")


@functools.cache
def register_attention(name: str = PACKED_ATTENTION, fn: Any = packed_attention_forward) -> str:
    """Register an attention function and its no-mask function with transformers (once per name)."""
    import transformers
    from transformers import AttentionInterface

    check_transformers_version(transformers.__version__)
    from transformers.masking_utils import AttentionMaskInterface

    # Each function decides itself what of it a compiled graph may hold (``torch.compiler.disable`` inside).
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _no_mask)
    return name


def attention_configs(layers: Any, attention_attr: str) -> list[Any]:
    """The distinct config objects the decoder's attention modules read their implementation from."""
    configs: dict[int, Any] = {}
    for layer in layers:
        attn = getattr(layer, attention_attr, None)
        config = getattr(attn, "config", None)
        if config is None:
            raise PackingNotAppliedError(
                f"decoder layer {type(layer).__name__} has no '{attention_attr}.config'; this transformers "
                "version lays attention out differently from what actorcore's arch spec expects"
            )
        configs[id(config)] = config
    return list(configs.values())


# Where transformers keeps a config's attention implementation (read back by ``_attn_implementation``).
_IMPLEMENTATION_ATTR = "_attn_implementation_internal"


def swap_attention_implementation(configs: list[Any], name: str) -> Callable[[], None]:
    """Set ``_attn_implementation`` on exactly these configs (not their sub-configs); return the undo."""
    missing = object()
    saved = [c.__dict__.get(_IMPLEMENTATION_ATTR, missing) for c in configs]

    def restore() -> None:
        for c, old in zip(configs, saved):
            if old is missing:
                c.__dict__.pop(_IMPLEMENTATION_ATTR, None)
            else:
                c.__dict__[_IMPLEMENTATION_ATTR] = old

    for c in configs:
        c.__dict__[_IMPLEMENTATION_ATTR] = name
        if getattr(c, "_attn_implementation", None) != name:
            restore()
            raise PackingNotAppliedError(
                f"{type(c).__name__}._attn_implementation does not read back as {name!r} after setting it; this "
                "transformers version stores the attention implementation elsewhere: actorcore must be updated"
            )
    return restore


@contextlib.contextmanager
def attention_implementation(configs: list[Any], name: str) -> Iterator[None]:
    """``swap_attention_implementation`` for the duration of a block."""
    restore = swap_attention_implementation(configs, name)
    try:
        yield
    finally:
        restore()


def current_implementations(configs: list[Any]) -> set[str | None]:
    return {c.__dict__.get(_IMPLEMENTATION_ATTR) for c in configs}


def packed_attention(decoder: torch.nn.Module, configs: list[Any], name: str) -> Any:
    """Switch ``configs`` to ``name`` for one forward, including the recomputation in backward
    (``switched_for_call``)."""
    return switched_for_call(decoder, functools.partial(attention_implementation, configs, name))
