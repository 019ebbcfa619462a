"""Tiled MLP under FSDP2 (gloo, 2 processes; float64, and bf16 mixed precision) with gradient accumulation over two micro-batches:
log-probs are bitwise the untiled FSDP2 model's, accumulated gradients equal the untiled ones and one
process's, and the tiled path demonstrably ran (recompute reads the parameters FSDP unsharded)."""

from collections import Counter

import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL
from support.fsdp_steps import MICRO_BATCHES, micro_batch_loss, micro_batches


SHARDS = 3


def _fsdp(model, bf16=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mp_policy": policy} if bf16 else {}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _bf16_mixed_precision(rank):
    """bf16 compute (FSDP2 mixed precision), fp32 reduce: tiled and untiled agree to bf16 rounding."""
    import actorcore as ac
    from actorcore.testing.tiny_configs import build_tiny_model

    plain = _fsdp(build_tiny_model("llama", seed=9), bf16=True)
    tiled = build_tiny_model("llama", seed=9)
    ac.patch_model(tiled, tiled_mlp_shards=SHARDS)
    tiled = _fsdp(tiled, bf16=True)
    worst_logprob = 0.0
    for i, seqs in enumerate(micro_batches()):
        for model in (plain, tiled):
            model.set_requires_gradient_sync(i == len(MICRO_BATCHES) - 1)
        loss_plain, lp_plain = micro_batch_loss(plain, seqs)
        loss_tiled, lp_tiled = micro_batch_loss(tiled, seqs)
        worst_logprob = max(worst_logprob, (lp_plain - lp_tiled).abs().max().item())
        loss_plain.backward()
        loss_tiled.backward()
    grad_rel = max(((q.grad.full_tensor() - p.grad.full_tensor()).abs().max()
                    / p.grad.full_tensor().abs().max()).item()
                   for p, q in zip(plain.parameters(), tiled.parameters()))
    return worst_logprob, grad_rel


def _worker(rank, world_size, model_type):
    import actorcore as ac
    from actorcore.testing.tiny_configs import build_tiny_model

    plain = _fsdp(build_tiny_model(model_type, seed=9, dtype=torch.float64))
    tiled = build_tiny_model(model_type, seed=9, dtype=torch.float64)
    ac.patch_model(tiled, tiled_mlp_shards=SHARDS)
    tiled = _fsdp(tiled)
    # Each rank gets its own micro-batch order; FSDP averages the accumulated gradients over ranks.
    micro = micro_batches() if rank == 0 else micro_batches()[::-1]
    bitwise, trace = [], Counter()
    for i, seqs in enumerate(micro):
        last = i == len(micro) - 1
        for model in (plain, tiled):
            model.set_requires_gradient_sync(last)
        loss_plain, lp_plain = micro_batch_loss(plain, seqs)
        loss_tiled, lp_tiled = micro_batch_loss(tiled, seqs, trace)
        bitwise.append(torch.equal(lp_plain, lp_tiled))
        loss_plain.backward()
        loss_tiled.backward()
    grads = {n: (p.grad.full_tensor(), q.grad.full_tensor())
             for (n, p), (_, q) in zip(plain.named_parameters(), tiled.named_parameters())}
    tiled_calls = trace["tiled_mlp:forward"]
    return {"bf16": _bf16_mixed_precision(rank), "bitwise": bitwise, "tiled_calls": tiled_calls,
            "expected_calls": len(micro) * tiled.config.num_hidden_layers, "grads": grads}


def test_tiled_mlp_under_fsdp2_with_gradient_accumulation():
    from actorcore.testing.tiny_configs import build_tiny_model

    # One process: both ranks' micro-batches, averaged over the two ranks.
    reference = build_tiny_model("llama", seed=9, dtype=torch.float64)
    total = sum(micro_batch_loss(reference, seqs)[0] for seqs in micro_batches()) + sum(
        micro_batch_loss(reference, seqs)[0] for seqs in micro_batches()[::-1])
    (total / 2).backward()
    results = run_distributed(_worker, 2, args=("llama",))
    for rank, r in enumerate(results):
        assert all(r["bitwise"]), f"rank {rank}: tiled log-probs differ from untiled under FSDP2"
        assert r["tiled_calls"] == r["expected_calls"], f"rank {rank}: tiled MLP ran {r['tiled_calls']} times"
        bf16_logprob, bf16_grad_rel = r["bf16"]
        assert bf16_logprob <= TOL["tiled_mlp_logprob_bf16"] and bf16_grad_rel <= TOL["tiled_mlp_grad_bf16_rel"], r["bf16"]
        for name, p in reference.named_parameters():
            plain, tiled = r["grads"][name]
            scale = p.grad.abs().max()
            assert ((tiled - plain).abs().max() / scale).item() <= TOL["tiled_mlp_fsdp_grad_fp64_rel"], f"{name}: tiled vs plain FSDP2"
            assert ((tiled - p.grad).abs().max() / scale).item() <= TOL["tiled_mlp_fsdp_grad_fp64_rel"], f"{name}: tiled vs one process"
