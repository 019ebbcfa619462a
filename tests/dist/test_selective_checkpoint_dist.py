"""Selective checkpointing (``patch_model(checkpointing="selective")`` and ``"auto"`` with a budget that keeps two
of three layers) composed with Ulysses SP (sp=2) + tiled MLP + activation offload, and with FSDP2 (dp=2) + offload,
on 2 gloo processes: log-probs, entropies and every parameter gradient bitwise those of the same setup under
``checkpointing="full"``, and the selective checkpoints ran in the planned layers on every rank."""

from collections import Counter

import pytest
import torch

from actorcore.testing.distributed import run_distributed

LENGTHS = ([30, 7, 24], [9, 50])  # the SP run uses the first batch (61 tokens: a padding segment, shard edge inside)


def _batch(i):
    import actorcore as ac

    g = torch.Generator().manual_seed(40 + i)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in LENGTHS[i]])


def _step(model, batch, parallel):
    import actorcore as ac
    from actorcore.hf.features.checkpointing import FULL_LAYERS, SELECTIVE_LAYERS
    from actorcore.kernels.selective_checkpoint import SELECTIVE_TRACE_KEY

    model.train()
    trace = Counter()
    out = ac.compute_logprobs(model, batch, temperature=0.8, parallel=parallel, trace=trace)
    weights = torch.linspace(0.5, 1.5, out.log_probs.numel())
    (-(out.log_probs * weights).sum() - 0.1 * out.entropy.sum()).backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]
    counts = (trace[FULL_LAYERS], trace[SELECTIVE_LAYERS], trace[SELECTIVE_TRACE_KEY], trace["offload:layers"])
    return out.log_probs.detach(), out.entropy.detach(), grads, counts


def _bitwise(a, b):
    return (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and len(a[2]) == len(b[2])
            and all(torch.equal(x, y) for x, y in zip(a[2], b[2])))


def _two_layer_budget(model, tokens):
    """A budget (GiB) with room for exactly two kept layers (the planner's rule: the checkpointed inputs and 1 GiB
    of slack, then the kept layers and the gradients of one), the weight gradients already there."""
    from actorcore.hf.features.checkpointing import layer_bytes_per_token

    config = model.config
    kept, inputs = layer_bytes_per_token(config, 4, fused=False)
    base = config.num_hidden_layers * inputs * tokens + 2**30
    return (base + 3.5 * kept * tokens) / 2**30


def _gradient_shards(model):
    """(per layer: the gradient bytes ``gradients_to_come`` counts, the layer's local shard bytes, its whole bytes)."""
    from actorcore.hf.features.checkpointing import gradients_to_come

    counted, _ = gradients_to_come(model, list(model.model.layers))
    return [(c, sum(p.to_local().numel() * p.element_size() for p in layer.parameters()),
             sum(p.numel() * p.element_size() for p in layer.parameters()))
            for c, layer in zip(counted, model.model.layers)]


def _worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import actorcore as ac
    from actorcore.parallel import ParallelContext
    from actorcore.testing.tiny_configs import build_tiny_model

    ctx = ParallelContext(sp_group=dist.new_group(list(range(world_size))))
    shard_tokens = -(-_batch(0).num_tokens // world_size)
    runs = []
    for mode in ("full", "selective", "auto"):
        model = build_tiny_model("llama", seed=3, num_hidden_layers=3)
        for param in model.parameters():  # a later micro-batch: the gradients are there
            param.grad = torch.zeros_like(param)
        budget = _two_layer_budget(model, shard_tokens) if mode == "auto" else None
        ac.patch_model(model, parallel=ctx, tiled_mlp_shards=3, offload_activations=True, checkpointing=mode,
                       memory_budget_gib=budget)
        runs.append(_step(model, _batch(0), ctx))
    sp = {"selective": _bitwise(runs[0], runs[1]), "auto": _bitwise(runs[0], runs[2]),
          "counts": [r[3] for r in runs], "layers": model.config.num_hidden_layers}

    runs = []
    for mode in ("full", "selective"):
        model = build_tiny_model("llama", seed=5)
        ac.patch_model(model, offload_activations=True, checkpointing=mode)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        if mode == "full":  # what checkpointing="auto" would count: this rank's shards of the gradients to come
            runs_shards = _gradient_shards(model)
        runs.append(_step(model, _batch(rank), None))
    fsdp = {"selective": _bitwise(runs[0], runs[1]), "counts": [r[3] for r in runs],
            "layers": model.config.num_hidden_layers, "shards": runs_shards}
    return {"sp": sp, "fsdp": fsdp}


@pytest.mark.dist
def test_selective_checkpointing_with_sequence_parallel_tiled_mlp_offload_and_fsdp2():
    for rank, r in enumerate(run_distributed(_worker, 2)):
        n = r["sp"]["layers"]
        assert r["sp"]["selective"] and r["sp"]["auto"], f"rank {rank} sp: selective changed the results"
        assert r["sp"]["counts"] == [(n, 0, 0, n), (0, n, n, n), (n - 2, 2, 2, n)], r["sp"]["counts"]
        assert r["fsdp"]["selective"], f"rank {rank} fsdp: selective changed the results"
        n = r["fsdp"]["layers"]
        assert r["fsdp"]["counts"] == [(n, 0, 0, n), (0, n, n, n)], r["fsdp"]["counts"]
        for counted, local, whole in r["fsdp"]["shards"]:  # each rank's own shard, not the whole layer
            assert counted == local < whole, (counted, local, whole)
