"""Parallel layout of a Megatron model: sizes (pure data) and the process groups of one rank.

Megatron keeps its groups in ``megatron.core.parallel_state``; actorcore reads them once, into a
``ParallelContext`` (``context_from_megatron()``, returned by ``initialize_megatron``), and passes it
explicitly to every function that communicates. Nothing here holds a module-level group.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from actorcore.parallel.context import ParallelContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class McoreParallel:
    """Sizes of the Megatron layout. ``vp``: virtual pipeline stages per rank (None: no interleaving)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    vp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "vp"):
            value = getattr(self, name)
            if name == "vp" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be >= 1 (an int), got {value!r}")
        if self.vp is not None and self.pp < 2:
            raise ValueError(f"vp={self.vp} needs pp >= 2 and vp >= 1")

    @property
    def world_size(self) -> int:
        """Smallest world that holds this layout (data parallel fills the rest)."""
        return self.pp * math.lcm(self.tp * self.cp, self.ep)

    def check_world(self, world: int) -> None:
        """Refuse a world this layout does not tile: tp x cp x pp must divide it, and ep the ranks of a stage."""
        if world % (self.tp * self.cp * self.pp) or (world // self.pp) % self.ep:
            raise ValueError(f"world size {world} does not fit tp={self.tp} x cp={self.cp} x pp={self.pp} "
                             f"with ep={self.ep}")

    def check_context(self, context: ParallelContext) -> None:
        """Refuse a context whose groups have other sizes than this layout (a model built for one layout run
        under another's groups would exchange wrong shapes or hang)."""
        found = {"tp": context.tp_size, "pp": context.pp_size, "ep": context.ep_size, "cp": context.cp_size}
        differ = [f"{k}={v} (the layout has {getattr(self, k)})" for k, v in found.items() if v != getattr(self, k)]
        if differ:
            raise ValueError(f"Megatron's parallel state does not match the layout: {', '.join(differ)}; call "
                             "initialize_megatron with the McoreParallel the model is built for")

    def token_multiple(self, sequence_parallel: bool) -> int:
        """What a packed THD batch's token count must be a multiple of: tp under sequence parallelism (Megatron
        splits the tokens over the TP ranks), times 2 x cp under context parallelism (the load-balanced split
        cuts every sequence into 2 x cp chunks)."""
        return (self.tp if sequence_parallel else 1) * (2 * self.cp if self.cp > 1 else 1)


def context_from_megatron() -> ParallelContext:
    """This rank's ``ParallelContext`` (dp, tp, pp, ep, cp groups) read from Megatron's ``parallel_state``.

    Megatron must be initialised (``initialize_megatron`` or the caller's own ``initialize_model_parallel``).
    ``dp`` is Megatron's data-parallel group without the context-parallel ranks; gradients are averaged over
    both (``parallel_state.get_data_parallel_group(with_context_parallel=True)``, as Megatron's DDP does).
    """
    from actorcore.mcore._megatron import require_megatron

    require_megatron()
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise ValueError("Megatron's parallel state is not initialised: call actorcore.mcore.initialize_megatron("
                         "McoreParallel(...)) (or megatron.core.parallel_state.initialize_model_parallel) first")
    return ParallelContext(dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
                           pp_group=ps.get_pipeline_model_parallel_group(),
                           ep_group=ps.get_expert_model_parallel_group(), cp_group=ps.get_context_parallel_group())


def _megatron_layout() -> dict[str, int | None]:
    """The layout Megatron's parallel state was initialised with, in ``McoreParallel``'s terms (+ expert TP)."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
            "vp": ps.get_virtual_pipeline_model_parallel_world_size(),
            "expert_tp": ps.get_expert_tensor_parallel_world_size()}


def initialize_megatron(parallel: McoreParallel, seed: int = 0) -> ParallelContext:
    """Set up Megatron's parallel state on an initialised ``torch.distributed`` world; return this rank's context.

    Expert tensor parallelism is fixed to 1 (experts are whole on their expert-parallel rank).

    When Megatron's parallel state is already initialised (by the caller, or an earlier call), it is never
    destroyed: with the same layout it is reused as it is; with another layout this raises ``ValueError``.
    Seeding follows the same rule: a fresh initialisation seeds Megatron's RNG tracker from ``seed`` (a new
    inference tracker, which on the CPU never forks CUDA generators); when reusing, a tracker that was set up
    (seeded states, or an inference tracker) is left alone and ``seed`` is ignored, since reseeding would
    replace the caller's tracker and reset the default CUDA generator; only a missing or empty one is seeded.
    """
    import torch.distributed as dist

    from actorcore.mcore._megatron import require_megatron

    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    parallel.check_world(dist.get_world_size())
    if ps.model_parallel_is_initialized():
        wanted = {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep, "cp": parallel.cp, "vp": parallel.vp,
                  "expert_tp": 1}
        found = _megatron_layout()
        if found != wanted:
            differ = ", ".join(f"{k}={found[k]} (wanted {wanted[k]})" for k in wanted if found[k] != wanted[k])
            raise ValueError(
                f"Megatron's parallel state is already initialised with another layout: {differ}. actorcore does not "
                "destroy a caller's Megatron state: pass the layout it was initialised with, or call "
                "megatron.core.parallel_state.destroy_model_parallel() yourself first")
        tracker = get_cuda_rng_tracker()  # creates an empty plain tracker if there is none
        if tracker.is_initialized() or tracker.is_inference_rng_tracker:
            # Set up by the caller (or an earlier call): reseeding would also reset the default CUDA generator.
            logger.info("reusing Megatron's parallel state and RNG tracker as they are (seed=%d not applied)", seed)
        else:
            model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
        return context_from_megatron()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        virtual_pipeline_model_parallel_size=parallel.vp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=1,
    )
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    return context_from_megatron()
