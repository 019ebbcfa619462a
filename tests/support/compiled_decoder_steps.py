"""One training step of a model on the GPU, as the compiled-decoder, MoE and quack GPU tests run it."""

from __future__ import annotations

import torch

import actorcore as ac


def step(model, batch, trace):
    out = ac.compute_logprobs(model, batch, temperature=0.9, trace=trace)
    weights = torch.linspace(0.5, 1.5, out.log_probs.numel(), device="cuda")
    (-(out.log_probs * weights).sum() - 0.1 * out.entropy.sum()).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.log_probs.detach(), out.entropy.detach(), grads
