"""The core attention's rotated q and k recomputed for its backward from the QKV projection, not kept.

Why: the attention kernel keeps its inputs, the rotated q and k, for its backward, while the QKV projection's output
(q and k before their norms, and v) is kept anyway, for the q/k norms' backward and as v. On the Qwen3-30B-A3B shape
the rotated q and k are 9 KB per token per layer (32 query and 4 key heads of 128 in bf16), about 2.4 GB over 8 layers
at 32K tokens. Here the layer collects, for one call, which tensors are the normed and the rotated q and k
(``RotatedQk``: ``FusedQkNormAttention`` notes the norms' inputs and outputs, ``PackedCoreAttention`` the rotation);
a saved-tensor hook around the attention then keeps, for a saved rotated q or k, a token instead, and its backward
reruns the q/k norms' and the rotation's compiled graphs on the kept projection (with gradients on, as in the
forward: the same kernels, so bitwise the tensors the kernel saw).

Where: a compiled layer whose q/k norms are fused (``qk_norm.py``) and whose RoPE runs in the core attention
(``fused_rope.py``), in a training forward that keeps its activations (recompute mode ``"none"``: a checkpointed
layer recomputes them anyway). Counted in the call's trace under ``ROTATED_QK_KEY`` per forward whose attention saved
a rotated q or k as a token (a backend that saves other tensors, e.g. SDPA's scaled copies, keeps what it keeps).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from actorcore.kernels.recomputed_input import recompute

ROTATED_QK_KEY = "mcore:recomputed_rotated_qk"  # layer forwards whose attention kept no rotated q and k
_LENT = "_rotated_qk"


def lent(module: torch.nn.Module) -> RotatedQk | None:
    """The record a layer lent ``module`` for this call (None outside ``RotatedQk.collecting``)."""
    return module.__dict__.get(_LENT)


@dataclass
class _Rotation:
    """One attention call's rotated q and k: how to make them again from the kept projection, and how many saved
    views of them are still to be given back (the made tensors are dropped after the last)."""

    normed: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    rotate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    storages: dict[int, int]  # storage address of the rotated q (0) and k (1)
    layouts: tuple  # (shape, stride) of q and k as rotated (Megatron views them between the norms and the rotation)
    made: tuple[torch.Tensor, ...] | None = None
    outstanding: int = 0

    def again(self, which: int) -> torch.Tensor:
        if self.made is None:
            # as the forward rotated them: Megatron's views of the norms' outputs, which required gradients
            q, k = (t.as_strided(shape, stride, t.storage_offset()).requires_grad_()
                    for t, (shape, stride) in zip(self.normed(), self.layouts))
            self.made = recompute(self.rotate, q, k)
        tensor = self.made[which]
        self.outstanding -= 1
        if self.outstanding <= 0:
            self.made = None
        return tensor


class RotatedQk:
    """One layer call's record of its normed and rotated q and k, and the saved-tensor hooks that keep tokens for
    the rotated ones (``collecting``)."""

    def __init__(self) -> None:
        self.outer: tuple | None = None
        self.tokens = 0
        self.normed: dict[tuple, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {}
        self.rotations: list[_Rotation] = []

    def note_normed(self, query: torch.Tensor, key: torch.Tensor, sources: tuple[torch.Tensor, torch.Tensor],
                    norms: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``(query, key) == norms(*sources)``: the q/k norms' outputs and how to make them again."""
        self.normed[_where(query, key)] = functools.partial(recompute, norms, *sources)

    def note_rotated(self, query: torch.Tensor, key: torch.Tensor, rotated: tuple[torch.Tensor, torch.Tensor],
                     rotate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """``rotated == rotate(query, key)``; whether ``query`` and ``key`` are noted norm outputs (then the rotated
        ones are made again in backward instead of kept)."""
        normed = self.normed.get(_where(query, key))
        if normed is None:
            return False
        storages = {t.untyped_storage().data_ptr(): i for i, t in enumerate(rotated)}
        if len(storages) != 2:  # q and k in one buffer: a token could not say which
            return False
        self.rotations.append(_Rotation(normed, rotate, storages, tuple((t.shape, t.stride()) for t in (query, key))))
        return True

    @contextlib.contextmanager
    def collecting(self, attention: torch.nn.Module, core_attention: torch.nn.Module) -> Iterator[None]:
        """Within the block: the two modules note their q and k here (``lent``), and the rotated ones saved for
        backward are kept as tokens."""
        modules = (attention, core_attention)
        # hooks already installed (a caller's offload or measurement) keep seeing every other saved tensor
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        for module in modules:
            module.__dict__[_LENT] = self  # not a submodule attribute: for this call only
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            for module in modules:
                module.__dict__.pop(_LENT, None)

    def recomputes(self) -> bool:
        """Whether a rotated q or k was saved for backward as a token (to be made again), not kept."""
        return self.tokens > 0

    def _pack(self, tensor: torch.Tensor) -> Any:
        address = tensor.untyped_storage().data_ptr()
        for rotation in self.rotations:
            which = rotation.storages.get(address)
            if which is not None:
                rotation.outstanding += 1
                self.tokens += 1
                return _Token(rotation, which, tensor.shape, tensor.stride(), tensor.storage_offset())
        return tensor if self.outer is None else _Outer(self.outer[0](tensor))

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Token):
            return saved.rotation.again(saved.which).as_strided(saved.shape, saved.stride, saved.offset)
        return self.outer[1](saved.packed) if isinstance(saved, _Outer) else saved


@dataclass(frozen=True)
class _Outer:
    packed: Any  # what the hooks outside made of a saved tensor


@dataclass(frozen=True)
class _Token:
    rotation: _Rotation
    which: int
    shape: torch.Size
    stride: tuple
    offset: int


def _where(query: torch.Tensor, key: torch.Tensor) -> tuple:
    """The memory two tensors show (views of them match: Megatron reshapes q and k between the norms and the core
    attention), and their versions."""
    return tuple((t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t._version) for t in (query, key))
