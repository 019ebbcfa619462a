"""compat.verl without fused kernels under FSDP2 (2 gloo ranks): verl 0.7.1's actor divides the returned logits
in place (``logits_rmpad = output.logits.squeeze(0); logits_rmpad.div_(temperature)``); the gradients must equal
the out-of-place division's and one process's (FSDP2 registers its pre-backward hook on the returned tensor)."""

import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

LENGTHS = (9, 4, 15)
TEMPERATURE = 0.7


def _inputs():
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 131, (n,), generator=g) for n in LENGTHS]
    return torch.cat(seqs)[None], torch.cat([torch.arange(n) for n in LENGTHS])[None]


def _step(model, inplace, rank):
    """verl's non-fused log-prob step on this rank's micro-batch (each rank its own: the ranks' orders differ)."""
    ids, pos = _inputs()
    if rank == 1:
        ids = ids.flip(1)
    labels = torch.roll(ids, shifts=-1, dims=1)[0]
    logits = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits.squeeze(0)
    logits = logits.div_(TEMPERATURE) if inplace else logits / TEMPERATURE
    logp = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
    logp.sum().backward()


def _worker(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from actorcore.compat.verl import apply_monkey_patch
    from actorcore.testing.tiny_configs import build_tiny_model

    grads = {}
    for inplace in (False, True):
        model = build_tiny_model("llama", seed=4, dtype=torch.float64)
        apply_monkey_patch(model, use_fused_kernels=False)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        _step(model, inplace, rank)
        grads[inplace] = {n: p.grad.full_tensor() if p.grad is not None else None for n, p in model.named_parameters()}
    return grads


def test_in_place_division_of_the_logits_under_fsdp2_keeps_the_gradients():
    from actorcore.compat.verl import apply_monkey_patch
    from actorcore.testing.tiny_configs import build_tiny_model

    reference = build_tiny_model("llama", seed=4, dtype=torch.float64)
    apply_monkey_patch(reference, use_fused_kernels=False)
    for rank in (0, 1):
        _step(reference, False, rank)
    tol = TOL["grad_packed_vs_hf_fp32_rel"]
    for rank, grads in enumerate(run_distributed(_worker, 2)):
        for name, p in reference.named_parameters():
            want = p.grad / 2  # FSDP2 averages over the 2 ranks
            for inplace in (False, True):
                got = grads[inplace][name]
                assert got is not None, f"rank {rank} inplace={inplace}: {name} has no gradient"
                rel = ((got - want).abs().max() / want.abs().max()).item()
                assert rel <= tol, f"rank {rank} inplace={inplace}: {name} relative gradient diff {rel:.2e}"
