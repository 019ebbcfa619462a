"""LoRA (PEFT) under FSDP2 and Ulysses SP=2 on 2 gloo ranks: per-token log-probs and the adapters' gradients
equal one process's; the frozen base weights get no gradient."""

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL


def _lora(seed):
    import peft

    from actorcore.testing.tiny_configs import build_tiny_model

    model = peft.get_peft_model(build_tiny_model("llama", seed=seed),
                                peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "up_proj"],
                                                lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return model


def _worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import actorcore as ac

    g = torch.Generator().manual_seed(3)
    batch = ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (7, 12, 4)])
    reference = _lora(seed=4)
    ref = ac.compute_logprobs(reference, batch, temperature=0.9)
    (ref.log_probs.sum() + 0.5 * ref.entropy.sum()).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("sp",))
    ctx = ac.ParallelContext.from_device_mesh(mesh, sp="sp")
    model = _lora(seed=4)
    ac.patch_model(model, parallel=ctx, tiled_mlp_shards=2)
    for layer in model.get_base_model().model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out = ac.compute_logprobs(model, batch, temperature=0.9, parallel=ctx)
    (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
    # FSDP2 averages over the mesh (the SP group here): the averaged gradients are the single-process ones.
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return {"logprob": (out.log_probs - ref.log_probs).abs().max().item(),
            "entropy": (out.entropy - ref.entropy).abs().max().item(),
            "grad_names": (sorted(got), sorted(want)),
            "grad_rel": {n: ((got[n] - w).abs().max() / w.abs().max().clamp(min=1e-30)).item()
                         for n, w in want.items() if n in got}}


def test_lora_under_fsdp2_and_ulysses_sp2():
    pytest.importorskip("peft")
    for r in run_distributed(_worker, 2):
        assert r["logprob"] <= TOL["sp_vs_single_fp32"] and r["entropy"] <= TOL["sp_vs_single_fp32"], r
        got, want = r["grad_names"]
        assert got == want and want and all("lora_" in n for n in want), (got, want)
        assert max(r["grad_rel"].values()) <= TOL["grad_sp_vs_single_fp32_rel"], r["grad_rel"]
