"""CUDA, 2 devices: ``checkpointing="auto"`` under FSDP2 counts FSDP2's whole copies (the running and prefetched
layers' parameters, a layer's gradients and their reduce-scatter input, the head's gradient held whole to the end of
backward: ``parallel.fsdp_memory``) and each rank's peak stays within the budget, in a step's first micro-batch and in
a later one, while some layers are kept. Skipped without 2 CUDA devices."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

LAYERS = 8


def _worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import actorcore as ac
    from actorcore.hf.features.checkpointing import FULL_LAYERS, layer_bytes_per_token
    from actorcore.parallel.fsdp_memory import fsdp_gathered_bytes
    from actorcore.testing.tiny_configs import build_tiny_model

    torch.cuda.set_device(rank)
    mesh = DeviceMesh.from_group(dist.new_group(list(range(world_size)), backend="nccl"), "cuda")
    model = build_tiny_model("llama", seed=0, dtype=torch.bfloat16, hidden_size=1024, intermediate_size=2816,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_hidden_layers=LAYERS,
                             vocab_size=32768).cuda().train()
    g = torch.Generator().manual_seed(rank)
    batch = ac.pack([torch.randint(3, 32768, (int(n),), generator=g)
                     for n in torch.randint(300, 1500, (12,), generator=g)]).to("cuda")
    tokens = batch.num_tokens
    kept, checkpointed_input = layer_bytes_per_token(model.config, 2, fused=True)
    layer_bytes = sum(p.numel() for p in model.model.layers[0].parameters()) * 2
    head_bytes = model.lm_head.weight.numel() * 2
    # Room for about three estimated kept layers beside: the shards and their gradients, every layer's checkpointed
    # input, 1 GiB of slack, the root's gathered embedding and head, and FSDP2's copies (counted as the planner does).
    sharded = sum(p.numel() for p in model.parameters()) * 2 * 2 / world_size
    root = (model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()) * 2
    copies = 4 * layer_bytes + head_bytes
    budget = sharded + root + LAYERS * checkpointed_input * tokens + 2**30 + copies + 4 * kept * tokens
    ac.patch_model(model, checkpointing="auto", memory_budget_gib=budget / 2**30, swiglu_mlp=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    seen = []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(fsdp_gathered_bytes(model, list(model.model.layers),
                                                                     model.lm_head.weight)), with_kwargs=True)
    peaks, full = [], []
    for step in range(3):  # a first micro-batch (no gradients yet), then two later ones
        torch.cuda.reset_peak_memory_stats()
        trace = Counter()
        out = ac.compute_logprobs(model, batch, trace=trace)
        (-(out.log_probs * torch.linspace(0.5, 1.5, tokens, device="cuda")).sum()).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        full.append(trace[FULL_LAYERS])
    hook.remove()
    return {"peaks": peaks, "full": full, "budget": budget, "counted": seen[0].held + seen[0].window,
            "copies": copies}


def test_auto_under_fsdp2_counts_its_copies_and_stays_within_the_budget():
    from actorcore.testing.distributed import run_distributed

    for rank, r in enumerate(run_distributed(_worker, 2)):
        assert r["counted"] == r["copies"], (rank, r)
        assert all(0 < f < LAYERS for f in r["full"]), (rank, r["full"])  # some layers kept, some not
        assert max(r["peaks"]) <= r["budget"], (rank, [p / 2**30 for p in r["peaks"]], r["budget"] / 2**30)
