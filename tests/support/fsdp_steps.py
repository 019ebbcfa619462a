"""Micro-batches and the per-token loss that the FSDP2 tests (tiled MLP, quack's gated MLP) train on."""

import torch


MICRO_BATCHES = ([40, 23], [9, 61, 17])  # 63 and 87 tokens: 3 shards of 32 tokens, the last one short


def micro_batches():
    g = torch.Generator().manual_seed(31)
    return [[torch.randint(3, 131, (n,), generator=g) for n in lens] for lens in MICRO_BATCHES]


def micro_batch_loss(model, seqs, trace=None):
    import actorcore as ac

    out = ac.compute_logprobs(model, ac.pack(seqs), trace=trace)
    return -(out.log_probs.sum() + 0.1 * out.entropy.sum()), out.log_probs.detach()
