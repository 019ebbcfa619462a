"""Norms that keep only their input for backward (``patch_model(..., recompute_norms=True)``).

Why: transformers' RMSNorm computes in fp32, so autograd keeps the fp32 copy of its input and the normalised
values (12 bytes per element of a bf16 model, besides the output the next linear keeps anyway). Measured on the
H200 at 512K tokens of a Llama-8B shape with offload (``bench/long_context.py --memory-phases``): the step's peak
(110.8 GiB) falls in a layer's MLP backward, 32 GiB above where that layer's recompute began, and each of the
layer's two norms added 16 GiB when recomputed. Under a non-reentrant checkpoint a norm keeps only its input (2
bytes per element) and runs again in backward: bitwise the same outputs and gradients, for one more
memory-bound pass per norm.

A ``RecomputedNormForward`` is the norm's instance ``forward``: an object holding its module (so a deep copy of
the model recomputes the copy's norm), counting its calls for the decoder's self-check. Outside autograd (no
gradient wanted) it is the plain forward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint

from actorcore.hf.instance_forwards import install_forwards, wrapped_forward

_NORM_SUFFIXES = ("RMSNorm", "LayerNorm")


def is_norm(module: torch.nn.Module) -> bool:
    """A per-token norm: torch's own, or a model's ``...RMSNorm`` / ``...LayerNorm`` leaf module."""
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return True
    return type(module).__name__.endswith(_NORM_SUFFIXES) and not any(True for _ in module.children())


class RecomputedNormForward:
    """The instance ``forward`` of a norm: its forward under a non-reentrant checkpoint when gradients flow."""

    def __init__(self, norm: torch.nn.Module, previous: Callable | None) -> None:
        self.norm = norm
        self.previous = previous  # an instance forward that was there before, else None (the class's)
        self.calls = 0  # forwards asked for (the decoder's self-check)
        self.runs = 0  # the norm's forward computed: calls, plus recomputations in backward

    @torch.compiler.disable  # inside a fused (compiled) layer the recomputed norm runs as it is
    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        if not (torch.is_grad_enabled() and (hidden_states.requires_grad or
                                             any(p.requires_grad for p in self.norm.parameters()))):
            return self._run(hidden_states, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(self._run, hidden_states, *args, use_reentrant=False,
                                                 preserve_rng_state=False, **kwargs)  # a norm draws nothing

    def _run(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.runs += 1
        return wrapped_forward(self.norm, self.previous)(hidden_states, *args, **kwargs)


def decoder_norms(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """Every per-token norm of the decoder (its layers' norms, per-head query/key norms, the final norm)."""
    return [module for module in decoder.modules() if is_norm(module)]


def install_recomputed_norms(norms: list[torch.nn.Module]) -> tuple[list[RecomputedNormForward], Callable[[], None]]:
    """Install a ``RecomputedNormForward`` on each norm; returns them and the function that restores the norms."""

    def make(norm: torch.nn.Module, previous: Callable | None) -> RecomputedNormForward:
        if isinstance(previous, RecomputedNormForward):
            raise ValueError(f"{type(norm).__name__} already recomputes in backward (another actorcore patch); "
                             "revert it first")
        return RecomputedNormForward(norm, previous)

    return install_forwards(norms, make)
