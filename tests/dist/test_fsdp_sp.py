"""A 2-D mesh (dp=2 x sp=2, 4 gloo processes) with FSDP2 over both axes, Ulysses SP and tiled MLP on:
one optimizer step gives the parameters one process gets from the union of the two dp batches.

FSDP2 casts forward inputs as verl configures it (``MixedPrecisionPolicy(cast_forward_inputs=True)``, fp32 here):
that cast rebuilds every dataclass in each layer's kwargs, so the SP context must reach the attention intact."""

from collections import Counter

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

# Per dp rank; totals 95 and 78 are not multiples of sp=2, and shard edges fall inside sequences.
LENGTHS = ([30, 41, 24], [9, 50, 19])
LR = 0.5
FP32_EPS = torch.finfo(torch.float32).eps


def _batches():
    g = torch.Generator().manual_seed(21)
    return [[torch.randint(3, 131, (n,), generator=g) for n in lens] for lens in LENGTHS]


def _loss(model, seqs, parallel, trace=None):
    import actorcore as ac

    out = ac.compute_logprobs(model, ac.pack(seqs), temperature=0.9, parallel=parallel, trace=trace)
    return -(out.log_probs.sum() + 0.1 * out.entropy.sum()) / out.log_probs.numel()


def _worker(rank, world_size, model_type):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import actorcore as ac
    from actorcore.testing.tiny_configs import build_tiny_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    ctx = ac.ParallelContext.from_device_mesh(mesh, dp="dp", sp="sp")
    fsdp_mesh = mesh["dp", "sp"]._flatten("dp_sp")

    model = build_tiny_model(model_type, seed=7)
    ac.patch_model(model, parallel=ctx, tiled_mlp_shards=3)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    trace = Counter()
    _loss(model, _batches()[ctx.dp_rank], ctx, trace).backward()
    optimizer.step()
    ran = trace["attention:actorcore_ulysses"], trace["tiled_mlp:forward"]

    # One process, same initial weights, both dp batches, the dp-mean loss.
    reference = build_tiny_model(model_type, seed=7)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    (sum(_loss(reference, seqs, None) for seqs in _batches()) / len(LENGTHS)).backward()
    ref_optimizer.step()

    diffs = {}
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        update = (r.detach() - before[name]).abs().max().item()
        diffs[name] = ((p.full_tensor() - r.detach()).abs().max().item(), update, r.detach().abs().max().item())
    return {"ctx": (ctx.dp_size, ctx.dp_rank, ctx.sp_size, ctx.sp_rank), "ran": ran,
            "layers": model.config.num_hidden_layers, "diffs": diffs}


@pytest.mark.dist
def test_fsdp2_dp2_sp2_step_equals_one_process():
    results = run_distributed(_worker, 4, args=("qwen2",))
    assert sorted(r["ctx"] for r in results) == [(2, 0, 2, 0), (2, 0, 2, 1), (2, 1, 2, 0), (2, 1, 2, 1)]
    for rank, r in enumerate(results):
        attention_calls, mlp_calls = r["ran"]
        assert attention_calls == r["layers"] and mlp_calls == r["layers"], f"rank {rank}: patches did not run"
        for name, (diff, update, magnitude) in r["diffs"].items():
            assert update > 0, f"{name} did not move"
            # Gradient error relative to the update, plus the fp32 rounding of storing p - lr * g.
            allowed = TOL["grad_sp_vs_single_fp32_rel"] * update + 4 * FP32_EPS * magnitude
            assert diff <= allowed, f"rank {rank} {name}: |Δparam| {diff:.2e} > {allowed:.2e} (update {update:.2e})"
