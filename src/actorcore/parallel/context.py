"""``ParallelContext``: the process groups a call runs under, passed in explicitly.

There are no module-level groups and no ``set_/get_`` globals: every function that communicates takes a
context (or a group) as an argument. Sizes and ranks are read once, at construction.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

AXES = ("dp", "sp", "tp", "pp", "ep", "cp")


def sp_size(parallel: Any) -> int:
    """The SP size of a call's ``parallel`` argument (None: 1); anything that is not a context, or a context with
    a CP group, is refused here, the one place the HF route reads it."""
    if parallel is None:
        return 1
    if not hasattr(parallel, "sp_size"):
        raise ValueError(f"parallel must be an actorcore.ParallelContext or None, got {type(parallel).__name__}; "
                         "build one with ParallelContext(sp_group=...) or ParallelContext.from_device_mesh(...)")
    if getattr(parallel, "cp_size", 1) > 1:
        raise ValueError("the context has a context-parallel (cp) group, which only the Megatron route reads; the HF "
                         "route splits sequences with Ulysses: pass the group as sp_group instead")
    return int(parallel.sp_size)


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class ParallelContext:
    """Groups for each parallel axis (``None``: that axis has size 1 and this process is rank 0 on it).

    ``sp`` is Ulysses sequence parallelism; ``dp`` data parallelism (the FSDP axis may span dp and sp);
    ``tp``, ``pp``, ``ep``, ``cp`` tensor, pipeline, expert and context parallelism (the Megatron route builds
    its context from Megatron's groups with ``actorcore.mcore.parallel.context_from_megatron()``; its packed
    forward splits every sequence over the ``cp`` ranks).
    """

    dp_group: Any = None
    sp_group: Any = None
    tp_group: Any = None
    pp_group: Any = None
    ep_group: Any = None
    cp_group: Any = None
    _sizes: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _ranks: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for axis in AXES:
            group = getattr(self, f"{axis}_group")
            if group is not None and not dist.is_initialized():
                raise ValueError(f"{axis}_group was given but torch.distributed is not initialized")
            self._sizes[axis] = _size(group)
            self._ranks[axis] = _rank(group)
            if self._ranks[axis] < 0:
                raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the {axis} "
                                 "group it was given; pass the group this rank belongs to")

    # A context is frozen and its groups are process-wide: copies of an object holding one (a deep-copied model)
    # share it. Groups cannot leave their process, so pickling a context that has any is refused.
    def __copy__(self) -> "ParallelContext":
        return self

    def __deepcopy__(self, memo: dict) -> "ParallelContext":
        return self

    def __getstate__(self) -> dict[str, Any]:
        held = [axis for axis in AXES if getattr(self, f"{axis}_group") is not None]
        if held:
            raise pickle.PicklingError(
                f"a ParallelContext with process groups ({', '.join(f'{a}_group' for a in held)}) cannot be pickled: "
                "groups belong to the process that made them. Save the model's state_dict instead, or revert the "
                "patch that stored the context on the model (handle.revert()) before torch.save")
        return dict(self.__dict__)

    @classmethod
    def from_device_mesh(cls, mesh: Any, **axis_names: str | None) -> "ParallelContext":
        """Groups from named axes of a ``DeviceMesh``: ``from_device_mesh(mesh, sp="sp", dp="dp")``.

        Axis names are the caller's (a mesh may call its sequence axis "ulysses"); axes not named get no group.
        """
        unknown = set(axis_names) - set(AXES)
        if unknown:
            raise ValueError(f"unknown parallel axes {sorted(unknown)}; valid keywords are {', '.join(AXES)}")
        names = tuple(mesh.mesh_dim_names or ())
        groups = {}
        for axis, name in axis_names.items():
            if name is None:
                continue
            if name not in names:
                raise ValueError(f"{axis}={name!r} is not an axis of the device mesh; its axes are {names}")
            groups[f"{axis}_group"] = mesh.get_group(name)
        return cls(**groups)

    # Sizes and ranks: 1 and 0 for axes without a group.
    @property
    def dp_size(self) -> int:
        return self._sizes["dp"]

    @property
    def dp_rank(self) -> int:
        return self._ranks["dp"]

    @property
    def sp_size(self) -> int:
        return self._sizes["sp"]

    @property
    def sp_rank(self) -> int:
        return self._ranks["sp"]

    @property
    def tp_size(self) -> int:
        return self._sizes["tp"]

    @property
    def tp_rank(self) -> int:
        return self._ranks["tp"]

    @property
    def pp_size(self) -> int:
        return self._sizes["pp"]

    @property
    def pp_rank(self) -> int:
        return self._ranks["pp"]

    @property
    def ep_size(self) -> int:
        return self._sizes["ep"]

    @property
    def ep_rank(self) -> int:
        return self._ranks["ep"]

    @property
    def cp_size(self) -> int:
        return self._sizes["cp"]

    @property
    def cp_rank(self) -> int:
        return self._ranks["cp"]
