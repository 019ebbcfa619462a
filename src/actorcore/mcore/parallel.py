"""Parallel layout of a Megatron model: sizes (pure data) and the process groups of one rank.

Megatron keeps its groups in ``megatron.core.parallel_state``; actorcore reads them once, in
``McoreGroups.from_parallel_state()``, and passes the object explicitly to every function that issues a
collective. Nothing here holds a module-level group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class McoreParallel:
    """Sizes of the Megatron layout. ``vp``: virtual pipeline stages per rank (None: no interleaving)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    vp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vp is not None and (self.vp < 1 or self.pp < 2):
            raise ValueError(f"vp={self.vp} needs pp >= 2 and vp >= 1")
        if self.cp != 1:
            raise ValueError("context parallelism (cp > 1) is not supported by actorcore's packed attention yet")

    @property
    def world_size(self) -> int:
        """Smallest world that holds this layout (data parallel fills the rest)."""
        return self.pp * math.lcm(self.tp, self.ep)


@dataclass(frozen=True)
class McoreGroups:
    """This rank's groups and ranks within them (taken from Megatron's parallel_state once)."""

    tp_group: Any
    pp_group: Any
    ep_group: Any
    world_group: Any
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    ep_rank: int
    ep_size: int

    @classmethod
    def from_parallel_state(cls) -> "McoreGroups":
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        return cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
            ep_group=ps.get_expert_model_parallel_group(),
            world_group=dist.group.WORLD,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
        )


def initialize_megatron(parallel: McoreParallel, seed: int = 0) -> McoreGroups:
    """Set up Megatron's parallel state on an initialised ``torch.distributed`` world; return the groups.

    Expert tensor parallelism is fixed to 1 (experts are whole on their expert-parallel rank).
    """
    import torch.distributed as dist

    from actorcore.mcore._megatron import require_megatron

    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    world = dist.get_world_size()
    if world % (parallel.tp * parallel.pp) or (world // parallel.pp) % parallel.ep:
        raise ValueError(f"world size {world} does not fit tp={parallel.tp} x pp={parallel.pp} with ep={parallel.ep}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=1,
    )
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    return McoreGroups.from_parallel_state()
