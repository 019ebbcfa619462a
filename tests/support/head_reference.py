"""Test support: the lm head in fp64 on hidden states captured from a model's decoder.

Legend: ``T`` packed tokens, ``D`` hidden, ``V`` vocabulary. Used to check that the head computes in fp32 from
whatever the decoder produced (e.g. inside a caller's ``torch.autocast`` region), independently of actorcore.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from actorcore.batch import PackedBatch


@contextlib.contextmanager
def captured_final_hidden(model: Any) -> Iterator[list[torch.Tensor]]:
    """Collects the decoder's final hidden states ``[1, T, D]`` of each forward (with ``retain_grad``)."""
    seen: list[torch.Tensor] = []

    def hook(module: Any, args: Any, output: Any) -> None:
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        if hidden.requires_grad:
            hidden.retain_grad()
        seen.append(hidden)

    handle = model.get_decoder().register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def head_fp64(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, batch: PackedBatch,
              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies in the scored-token layout (0 at each sequence's first token), fp64.

    Differentiable w.r.t. ``hidden_TD`` and ``weight_VD`` (pass fp64 leaves to get reference gradients).
    """
    logp_TV = torch.log_softmax(hidden_TD.double() @ weight_VD.double().t() / temperature, dim=-1)
    ent_T = -(logp_TV.exp() * logp_TV).sum(-1)
    ids = batch.input_ids
    log_probs, entropy = [], []
    bounds = batch.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        zero = logp_TV.new_zeros(1)
        scored = logp_TV[start:end - 1].gather(1, ids[start + 1:end, None].long())[:, 0]
        log_probs.append(torch.cat([zero, scored]))
        entropy.append(torch.cat([zero, ent_T[start:end - 1]]))
    return torch.cat(log_probs), torch.cat(entropy)
