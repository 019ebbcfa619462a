"""What FSDP2 (``fully_shard``) holds on the device beside a training call's activations, for a memory planner.

Why: a model sharded by FSDP2 keeps only this rank's shard of each parameter between uses. For each layer it runs,
FSDP2 also holds whole ("unsharded") copies: the running layer's parameters and the next one's, prefetched; in
backward, the layer's whole gradients and the reduce-scatter input they are copied into. A group that is not
resharded after forward (the root's, by default, which holds the embedding and the output layer of a model sharded
per decoder layer) keeps its whole parameters from the forward to the end of the backward. So does the output
layer's whole gradient, because the root's gradients are reduce-scattered only after the embedding's backward. On
the Qwen3-8B shape over 2 ranks this is about 5 GB on top of the shards. The allocator's count when a call plans (inside
the model's forward) holds the root's gathered 2.5 GB; a planner that counts only that misses the other 2.8 GB.

How: each FSDP2 module's parameter group gives its whole sizes and dtype (its mixed-precision ``param_dtype``) and
whether it reshards after forward; where this torch's FSDP2 does not expose them, FSDP2's defaults are assumed (the
root's group held, the others resharded; the parameters' own dtype) and a warning says so. Sizes only: nothing is
gathered or synchronised.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatheredBytes:
    """FSDP2's whole copies beside a layer's backward, in bytes.

    Beyond what the allocator holds when a call plans (inside the model's forward: the root's group is gathered by
    then). ``held``: there at every decoder layer's backward: the parameters of groups not resharded after forward
    and not gathered yet (their share for groups resharded to fewer ranks), and the output layer's gradient where
    its group is held. ``window``: the decoder layers' own, at the layer that runs: its parameters and the next
    layer's, its gradients and the reduce-scatter input (the largest layer's).
    ``tail``: the output layer's parameters where its group reshards (gathered again for its backward, before any
    layer's backward). ``head_gradient_held``: the output layer's gradient is formed whole and stays whole until the
    end of backward (its shard comes only then). ``compute_element_bytes``: bytes per element of the dtype the layers
    compute in (the groups' ``param_dtype``), or 0 where nothing is sharded. ``layer_gradients``: per decoder layer,
    None where its gradients are reduce-scattered into shards in its backward, else the whole gradients its backward
    allocates anew and keeps (``set_requires_gradient_sync(False)``: 0 once they are there)."""

    held: float = 0.0
    window: float = 0.0
    tail: float = 0.0
    head_gradient_held: bool = False
    compute_element_bytes: int = 0
    layer_gradients: tuple[float | None, ...] = ()


@dataclass(frozen=True)
class _Group:
    """One FSDP2 parameter group: its parameters (one tensor each), the ids they go by (FSDP2 registers the whole
    parameter in the module while the group is gathered, the shard otherwise), the share of its whole parameters it
    holds after forward (1: not resharded; 1/k: resharded to k ranks, ``reshard_after_forward=k``; 0: resharded),
    its compute dtype's bytes and whether it is gathered now (then the allocator counts it already)."""

    params: tuple[torch.Tensor, ...]
    ids: frozenset[int]
    held: float
    element_bytes: int
    gathered_now: bool
    reduces: bool = True  # gradients reduce-scattered in the group's backward (else kept whole across calls)
    grad_element_bytes: int = 0  # of the whole gradients it keeps (its reduce dtype's)
    whole_grads_now: frozenset[int] = frozenset()  # ids (sharded and whole) of parameters with a whole gradient kept

    def whole_bytes(self, trainable_only: bool = False) -> float:
        return float(sum(p.numel() for p in self.params if p.requires_grad or not trainable_only) * self.element_bytes)

    def kept_gradients_to_come(self) -> float:
        """Whole gradients this group's backward allocates and keeps (not reducing): those not there yet."""
        return float(sum(p.numel() for p in self.params if p.requires_grad and id(p) not in self.whole_grads_now)
                     * (self.grad_element_bytes or self.element_bytes))


def fsdp_gathered_bytes(model: torch.nn.Module, layers: Iterable[torch.nn.Module],
                        head_weight: torch.Tensor | None) -> GatheredBytes:
    """``GatheredBytes`` of ``model`` (zeros where it is not sharded by FSDP2): ``layers`` are its decoder layers,
    ``head_weight`` the output layer's weight (None: none). Read when the model's forward has started, after FSDP2's
    lazy initialisation, which decides the root."""
    groups = _groups(model)
    if not groups:
        return GatheredBytes()
    layer_params = [{id(p) for p in layer.parameters()} for layer in layers]
    layer_grads: list[float | None] = [None] * len(layer_params)
    window, held, tail, head_held = 0.0, 0.0, 0.0, False
    for group in groups:
        ids = group.ids
        in_head = head_weight is not None and id(head_weight) in ids
        if not group.gathered_now:
            held += group.held * group.whole_bytes()
        if group.held == 1.0:
            # formed whole in this call and kept to the end of backward, unless kept whole from an earlier one
            if in_head and head_weight.requires_grad and id(head_weight) not in group.whole_grads_now:
                head_held = True
                held += head_weight.numel() * group.element_bytes
        elif in_head:
            tail += group.whole_bytes()
        owners = [i for i, params in enumerate(layer_params) if ids & params]
        if len(owners) == 1:  # one decoder layer's own group
            params = 0.0 if group.held == 1.0 else 2 * group.whole_bytes()
            if group.reduces:  # its gradients and their reduce-scatter input
                window = max(window, params + 2 * group.whole_bytes(trainable_only=True))
            else:  # kept whole: gradients to come, then allocated
                window = max(window, params)
                layer_grads[owners[0]] = (layer_grads[owners[0]] or 0.0) + group.kept_gradients_to_come()
    return GatheredBytes(held, window, tail, head_held, max(g.element_bytes for g in groups),
                         tuple(layer_grads) if any(g is not None for g in layer_grads) else ())


def _groups(model: torch.nn.Module) -> list[_Group]:
    """Each FSDP2 module's parameter groups under ``model`` (none: not sharded by FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    groups = []
    for module in modules:
        read = _param_groups(module)
        if read is None:
            own = _own_params(module, modules)
            root = module is modules[0]  # planned inside its forward: gathered
            read = [(own, {id(p) for p in own}, float(root), None, root)]
        for params, ids, held, dtype, gathered, *grads in read:
            if params:
                element = (dtype or params[0].dtype).itemsize
                groups.append(_Group(tuple(params), frozenset(ids), held, element, gathered, *grads))
    return groups


def _param_groups(module: Any) -> list[tuple] | None:
    """``(parameters, their ids sharded and whole, held after forward, compute dtype, gathered now, reduces, bytes
    per element of a kept whole gradient, ids with a whole gradient kept)`` of each of the module's FSDP2 parameter
    groups, from FSDP2's state; None where this torch's FSDP2 does not expose it as read here."""
    try:
        state = module._get_fsdp_state()
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:
            found = [g for g in (state._fsdp_param_group,) if g is not None]
        out = []
        for group in found:
            params = [p.sharded_param for p in group.fsdp_params]
            ids = {id(t) for p in group.fsdp_params for t in (p.sharded_param, getattr(p, "_unsharded_param", None))
                   if t is not None}
            dtype = next((p.param_dtype for p in group.fsdp_params if p.param_dtype is not None), None)
            reduce = next((p.reduce_dtype for p in group.fsdp_params if p.reduce_dtype is not None), None)
            kept = {id(t) for p in group.fsdp_params if _whole_gradient(p) is not None
                    for t in (p.sharded_param, getattr(p, "_unsharded_param", None)) if t is not None}
            out.append((params, ids, _held_share(group), dtype, bool(group.is_unsharded),
                        bool(getattr(group, "reduce_grads", True)), reduce.itemsize if reduce else 0,
                        frozenset(kept)))
        return out
    except AttributeError as err:
        _warn_unreadable(str(err))
        return None


def _held_share(group: Any) -> float:
    """The share of its whole parameters a group holds from its forward to its backward."""
    post = group.post_forward_mesh_info
    if post is None:
        return 1.0
    ranks = getattr(post, "shard_mesh_size", None)
    return 0.0 if not ranks or ranks == getattr(group.mesh_info, "shard_mesh_size", ranks) else 1.0 / ranks


def _whole_gradient(fsdp_param: Any) -> torch.Tensor | None:
    """The whole gradient FSDP2 keeps for a parameter between backwards that did not reduce (None: none)."""
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if accumulated is not None:
        return accumulated
    whole = getattr(fsdp_param, "_unsharded_param", None)
    return None if whole is None else whole.grad


@functools.cache
def _warn_unreadable(reason: str) -> None:
    """Once per process and reason (the planner reads this on every call)."""
    logger.warning("could not read FSDP2's parameter groups (%s); the memory planner assumes FSDP2's defaults (the "
                   "root's group held after forward, the others resharded, each parameter's own dtype)", reason)


def _own_params(module: torch.nn.Module, sharded: list[torch.nn.Module]) -> list[torch.Tensor]:
    """The parameters of ``module`` that no FSDP2 module inside it holds."""
    inner = {id(p) for m in sharded if m is not module and any(m is x for x in module.modules())
             for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in inner]
