"""Ulysses SP for hybrid linear-attention models on gloo: per-token log-probs and entropies equal one process's,
and parameter gradients averaged over the SP group equal one process's, for the Gated DeltaNet layers (heads and
conv channels split over ranks) and the gated full-attention layers alike.

Lengths 7 + 12 + 4 = 23 tokens: a padding segment is added, and the shard edge falls inside a sequence. The tiny
configs have 2 linear key heads serving 6 value heads: sp=2 splits them; Qwen3-Next also runs with 1 key head,
which sp=2 replicates (both ranks' value heads read it), as attention's kv heads (sp=4 would cost 4 processes on
the CPU for the same code path). Slow decays (small ``A``) keep the linear state alive across whole sequences, so a
wrong split or a leak at a shard edge would show. The same run checks FSDP2 over the SP ranks around the patched
model.
"""

from collections import Counter

import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

LENGTHS = (7, 12, 4)


def _sequences():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 131, (n,), generator=g) for n in LENGTHS]


def _model(model_type, overrides):
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model(model_type, seed=3, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-5.0, -2.0, generator=torch.Generator().manual_seed(5))
    return model


def _check_arch(model_type, overrides, ctx):
    import torch.distributed as dist

    import actorcore as ac

    batch = ac.pack(_sequences())
    w = 0.5 + torch.rand(2, batch.num_tokens, generator=torch.Generator().manual_seed(12))
    reference, actor = _model(model_type, overrides), _model(model_type, overrides)
    handle = ac.patch_model(actor, parallel=ctx)
    ref = ac.compute_logprobs(reference, batch, temperature=0.7)
    trace = Counter()
    out = ac.compute_logprobs(actor, batch, temperature=0.7, parallel=ctx, trace=trace)
    ((w[0] * ref.log_probs).sum() + (w[1] * ref.entropy).sum()).backward()
    ((w[0] * out.log_probs).sum() + (w[1] * out.entropy).sum()).backward()
    grads = {}
    for (name, p_ref), (_, p) in zip(reference.named_parameters(), actor.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=ctx.sp_group)
        grads[name] = ((g / ctx.sp_size - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp(min=1e-30)).item()
    handle.revert()
    types = actor.config.layer_types
    return dict(
        linear_calls=trace["linear_attention:actorcore_ulysses"], linear_layers=types.count("linear_attention"),
        attention_calls=trace["attention:actorcore_ulysses"], attention_layers=types.count("full_attention"),
        logprob=(out.log_probs - ref.log_probs).abs().tolist(), entropy=(out.entropy - ref.entropy).abs().tolist(),
        grads=grads, reverted="forward" not in actor.model.layers[0].linear_attn.__dict__,
    )


def _check_fsdp(model_type):
    """FSDP2 over the SP ranks (the linear-attention forward runs inside sharded layers): per-token outputs and
    the gradients FSDP2 reduces equal one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import actorcore as ac

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    ctx = ac.ParallelContext.from_device_mesh(mesh, sp="sp")
    batch = ac.pack(_sequences())
    reference, model = _model(model_type, {}), _model(model_type, {})
    ac.patch_model(model, parallel=ctx)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trace = Counter()
    out = ac.compute_logprobs(model, batch, parallel=ctx, trace=trace)
    ref = ac.compute_logprobs(reference, batch)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    (ref.log_probs.sum() + ref.entropy.sum()).backward()
    grads = {n: ((p.grad.full_tensor() - r.grad).abs().max() / r.grad.abs().max().clamp(min=1e-30)).item()
             for (n, p), (_, r) in zip(model.named_parameters(), reference.named_parameters())}
    return dict(linear_calls=trace["linear_attention:actorcore_ulysses"], grads=grads,
                logprob=(out.log_probs - ref.log_probs).abs().max().item(),
                entropy=(out.entropy - ref.entropy).abs().max().item())


def _worker(rank, world_size, archs):
    import torch.distributed as dist

    from actorcore.parallel import ParallelContext

    ctx = ParallelContext(sp_group=dist.new_group(list(range(world_size))))
    results = {f"{arch} {overrides}": _check_arch(arch, overrides, ctx) for arch, overrides in archs}
    results["fsdp"] = _check_fsdp(archs[0][0])
    return results


def _assert_results(results, sp_size, archs):
    for rank, res in enumerate(results):
        for arch, overrides in archs:
            r, where = res[f"{arch} {overrides}"], f"sp={sp_size} rank {rank} {arch} {overrides}"
            assert r["linear_calls"] == r["linear_layers"], f"{where}: Ulysses linear attention did not run"
            assert r["attention_calls"] == r["attention_layers"], f"{where}: Ulysses attention did not run"
            for key in ("logprob", "entropy"):
                worst = max(r[key])
                assert worst <= TOL["sp_vs_single_fp32"], f"{where}: {key} |Δ| {worst:.2e} at {r[key].index(worst)}"
            for name, rel in r["grads"].items():
                assert rel <= TOL["grad_sp_vs_single_fp32_rel"], f"{where}: {name} relative grad diff {rel:.2e}"
            assert r["reverted"]
        fsdp = res["fsdp"]
        assert fsdp["linear_calls"] == 1, f"rank {rank} FSDP2: Ulysses linear attention did not run"
        assert max(fsdp["logprob"], fsdp["entropy"]) <= TOL["sp_vs_single_fp32"], f"rank {rank} FSDP2: {fsdp}"
        for name, rel in fsdp["grads"].items():
            assert rel <= TOL["grad_sp_vs_single_fp32_rel"], f"rank {rank} FSDP2 {name}: relative grad diff {rel:.2e}"


def test_hybrid_sp2_matches_one_process():
    archs = (("qwen3_5_text", {}), ("qwen3_next", {}), ("qwen3_next", dict(linear_num_key_heads=1)))
    _assert_results(run_distributed(_worker, 2, args=(archs,)), 2, archs)
