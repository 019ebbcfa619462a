"""FSDP2 (gloo, 2 processes): compute_logprobs runs as the model's forward, so sharded parameters are
gathered for the decoder and the lm head, and the reduced gradients equal one process's on the union."""

import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

LENGTHS = [[7, 1, 30], [2, 19]]


def _batches():
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(3, 131, (n,), generator=g) for n in lens] for lens in LENGTHS]


def _loss(model, seqs):
    import actorcore as ac

    out = ac.compute_logprobs(model, ac.pack(seqs), temperature=0.9)
    return out.log_probs.sum() + 0.5 * out.entropy.sum()


def _fsdp_worker(rank, world_size, model_type):
    from torch.distributed.fsdp import fully_shard

    from actorcore.testing.tiny_configs import build_tiny_model

    grads = {}
    for separate_head in (False, True):
        model = build_tiny_model(model_type)
        for layer in model.model.layers:
            fully_shard(layer)
        if separate_head:
            fully_shard(model.lm_head)
        fully_shard(model)
        # Each rank's loss is over its own batch; FSDP averages gradients over ranks.
        _loss(model, _batches()[rank]).backward()
        grads[separate_head] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return grads


def test_fsdp2_gradients_equal_single_process():
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("qwen2")
    loss = sum(_loss(model, seqs) for seqs in _batches()) / len(LENGTHS)
    loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    results = run_distributed(_fsdp_worker, 2, args=("qwen2",))[0]
    for separate_head, got in results.items():
        for name, grad in want.items():
            rel = ((got[name] - grad).abs().max() / grad.abs().max()).item()
            assert rel <= TOL["grad_sp_vs_single_fp32_rel"], f"{name} (separate head={separate_head}): {rel:.2e}"
