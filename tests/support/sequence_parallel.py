"""Sequences, per-token loss weights and gradient comparisons of the Ulysses SP tests."""

import torch


LENGTHS = (7, 12, 4)


def sp_sequences():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 131, (n,), generator=g) for n in LENGTHS]


def loss_weights(num_tokens):
    """Positive per-token weights: no cancellation, so relative gradient errors are well conditioned (a
    scalar bias gradient summed from mixed-sign terms could be near zero)."""
    g = torch.Generator().manual_seed(12)
    return 0.5 + torch.rand(3, num_tokens, generator=g)


def grad_rel_diffs(reference, model, sp_group, sp_size):
    """max |avg_sp(grad) - grad_ref| / max |grad_ref| per parameter."""
    import torch.distributed as dist

    diffs = {}
    for (name, p_ref), (_, p) in zip(reference.named_parameters(), model.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=sp_group)
        g /= sp_size
        diffs[name] = ((g - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp(min=1e-30)).item()
    return diffs
