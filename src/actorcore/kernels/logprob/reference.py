"""Plain reference: full fp32 logits, log_softmax, entropy. Used by tests and benchmarks only.

Shape suffixes: T tokens, D hidden, V vocab. Builds [T, V] logits: memory grows with tokens x vocab.
"""

from __future__ import annotations

import torch

from actorcore.kernels.logprob._common import check_inputs, compute_dtype
from actorcore.kernels.precision import without_autocast


def linear_logprob_entropy_reference(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = True,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(label) and entropy from fp32 (fp64 for fp64 inputs) logits; autograd-differentiable.

    The definition every other backend must match: logits = hidden @ weight.T in fp32, then
    ``softcap * tanh(logits / softcap)`` if softcap, then divided by temperature. Plain autograd, with
    autocast off in forward and backward (``kernels.precision.without_autocast``).
    """
    check_inputs(hidden_TD, weight_VD, labels_T, temperature=temperature, softcap=softcap, entropy=entropy)
    return without_autocast(
        lambda h, w: _definition(h, w, labels_T, temperature=temperature, entropy=entropy, softcap=softcap),
        hidden_TD, weight_VD)


def _definition(hidden_TD, weight_VD, labels_T, *, temperature, entropy, softcap):
    cdt = compute_dtype(hidden_TD.dtype)
    logits_TV = hidden_TD.to(cdt) @ weight_VD.to(cdt).t()
    if softcap is not None:
        logits_TV = softcap * torch.tanh(logits_TV / softcap)
    z_TV = logits_TV / temperature
    logp_TV = torch.log_softmax(z_TV, dim=-1)
    logprob_T = logp_TV.gather(1, labels_T.long().unsqueeze(1)).squeeze(1)
    ent_T = -(logp_TV.exp() * logp_TV).sum(-1) if entropy else None
    return logprob_T, ent_T
