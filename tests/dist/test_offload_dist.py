"""Activation offload composed with Ulysses SP (sp=2) and tiled MLP (all layers, and the first one only), and with
FSDP2 (dp=2), on 2 gloo processes: log-probs, entropies and every parameter gradient bitwise those of the same setup
without offload, and the offload ran in every layer on every rank (each rank offloads its own shard's layer
inputs). The same with recomputed norms added (``recompute_norms=True``) on both setups."""

from collections import Counter

import torch

from actorcore.testing.distributed import run_distributed

LENGTHS = ([30, 7, 24], [9, 50])  # the SP run uses the first batch (61 tokens: a padding segment, shard edge inside)


def _batch(i):
    import actorcore as ac

    g = torch.Generator().manual_seed(40 + i)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in LENGTHS[i]])


def _step(model, batch, parallel):
    import actorcore as ac

    trace = Counter()
    out = ac.compute_logprobs(model, batch, temperature=0.8, parallel=parallel, trace=trace)
    weights = torch.linspace(0.5, 1.5, out.log_probs.numel())
    (-(out.log_probs * weights).sum() - 0.1 * out.entropy.sum()).backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]
    counts = (trace["offload:layers"], trace["offload:tensors"], trace["offload:restored"],
              trace["offload:kept_layers"])
    return out.log_probs.detach(), out.entropy.detach(), grads, counts


def _bitwise(a, b):
    return (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and len(a[2]) == len(b[2])
            and all(torch.equal(x, y) for x, y in zip(a[2], b[2])))


def _worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import actorcore as ac
    from actorcore.parallel import ParallelContext
    from actorcore.testing.tiny_configs import build_tiny_model, checkpointed

    ctx = ParallelContext(sp_group=dist.new_group(list(range(world_size))))
    runs = []
    for offload, norms in ((False, False), (True, False), (1, False), (True, True)):
        model = checkpointed(build_tiny_model("llama", seed=3))
        ac.patch_model(model, parallel=ctx, tiled_mlp_shards=3, offload_activations=offload, recompute_norms=norms)
        runs.append(_step(model, _batch(0), ctx))
    sp = {"bitwise": _bitwise(runs[0], runs[1]), "counts": runs[1][3], "plain_counts": runs[0][3],
          "partial_bitwise": _bitwise(runs[0], runs[2]), "partial_counts": runs[2][3],
          "norms_bitwise": _bitwise(runs[0], runs[3])}

    runs = []
    for offload, norms in ((False, False), (True, False), (True, True)):
        model = checkpointed(build_tiny_model("llama", seed=5))
        ac.patch_model(model, offload_activations=offload, recompute_norms=norms)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        runs.append(_step(model, _batch(rank), None))
    fsdp = {"bitwise": _bitwise(runs[0], runs[1]), "counts": runs[1][3], "plain_counts": runs[0][3],
            "norms_bitwise": _bitwise(runs[0], runs[2])}
    return {"sp": sp, "fsdp": fsdp, "layers": model.config.num_hidden_layers}


def test_offload_and_recomputed_norms_with_sequence_parallel_tiled_mlp_and_fsdp2():
    for rank, r in enumerate(run_distributed(_worker, 2)):
        layers = r["layers"]
        for name in ("sp", "fsdp"):
            assert r[name]["bitwise"], f"rank {rank} {name}: offload changed log-probs, entropies or gradients"
            assert r[name]["counts"] == (layers, layers, layers, 0), f"rank {rank} {name}: {r[name]['counts']}"
            assert r[name]["plain_counts"] == (0, 0, 0, 0)
            assert r[name]["norms_bitwise"], f"rank {rank} {name}: recomputed norms changed the results"
        assert r["sp"]["partial_bitwise"], f"rank {rank}: offloading the first layer changed the results"
        assert r["sp"]["partial_counts"] == (1, 1, 1, layers - 1), f"rank {rank}: {r['sp']['partial_counts']}"
