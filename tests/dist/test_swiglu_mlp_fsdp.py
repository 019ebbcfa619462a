"""quack's gated MLP (``patch_model(swiglu_mlp="quack")``) under FSDP2 (gloo, 2 processes, float64) with gradient
accumulation over two micro-batches, on ``testing.quack_stand_in``'s GEMMs (the CPU has no Hopper GPU): the path
reads the parameters FSDP2 unsharded in forward and again in backward, and its gradients reach FSDP2's
reduce-scatter. Log-probs per token and the accumulated gradients against one process running the model's own
forward on both ranks' micro-batches; the trace proves the path ran in every layer of every micro-batch."""

from collections import Counter

import torch
from support.fsdp_steps import micro_batch_loss, micro_batches  # the same micro-batches and loss

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL


def _worker(rank, world_size, patch_first):
    from torch.distributed.fsdp import fully_shard

    import actorcore as ac
    from actorcore.testing.quack_stand_in import use_quack_stand_in
    from actorcore.testing.tiny_configs import build_tiny_model

    use_quack_stand_in()
    model = build_tiny_model("qwen2", seed=9, dtype=torch.float64)
    if patch_first:
        handle = ac.patch_model(model, swiglu_mlp="quack")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if not patch_first:  # the parameters are FSDP2's sharded DTensors when the path is installed
        handle = ac.patch_model(model, swiglu_mlp="quack")
    micro = micro_batches() if rank == 0 else micro_batches()[::-1]
    trace, log_probs = Counter(), []
    for i, seqs in enumerate(micro):
        model.set_requires_gradient_sync(i == len(micro) - 1)
        loss, lp = micro_batch_loss(model, seqs, trace)
        log_probs.append(lp)
        loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"log_probs": log_probs, "grads": grads, "ran": trace["swiglu_mlp:modules"],
            "expected": len(micro) * len(handle.state.targets("swiglu_mlp")), "mlps": len(handle.state.targets("swiglu_mlp"))}


def test_swiglu_mlp_under_fsdp2_with_gradient_accumulation():
    from actorcore.testing.tiny_configs import build_tiny_model

    reference = build_tiny_model("qwen2", seed=9, dtype=torch.float64)  # the model's own forward, unpatched
    want_lp = [micro_batch_loss(reference, seqs)[1] for seqs in micro_batches()]
    total = sum(micro_batch_loss(reference, seqs)[0] for seqs in micro_batches()) + sum(
        micro_batch_loss(reference, seqs)[0] for seqs in micro_batches()[::-1])
    (total / 2).backward()  # FSDP2 averages the two ranks' accumulated gradients
    for patch_first in (True, False):
        results = run_distributed(_worker, 2, args=(patch_first,))
        for rank, r in enumerate(results):
            assert r["mlps"] == reference.config.num_hidden_layers and r["ran"] == r["expected"], r
            mine = want_lp if rank == 0 else want_lp[::-1]
            for want, got in zip(mine, r["log_probs"]):
                assert (want - got).abs().max().item() <= TOL["gated_mlp_fsdp_fp64"]
            for name, p in reference.named_parameters():
                scale = p.grad.abs().max()
                error = ((r["grads"][name] - p.grad).abs().max() / scale).item()
                assert error <= TOL["gated_mlp_fsdp_fp64"], (patch_first, rank, name, error)
