"""One seeded packed batch and one training step of a tiny model through compute_logprobs, and a bitwise
comparison of two steps: the decoder features' exactness tests (offload, checkpointing, compiled layers) share them."""

import torch

import actorcore as ac


LENGTHS = (40, 9, 27, 1)


def seeded_batch():
    g = torch.Generator().manual_seed(5)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in LENGTHS])


def train_step(model, batch, trace):
    out = ac.compute_logprobs(model, batch, temperature=0.9, trace=trace)
    weights = torch.linspace(0.5, 1.5, out.log_probs.numel())
    (-(out.log_probs * weights).sum() - 0.1 * out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


def assert_bitwise(a, b):
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = a, b
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
