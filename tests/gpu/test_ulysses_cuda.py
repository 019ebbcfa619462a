"""CUDA + NCCL (2 GPUs): Ulysses SP equals one process per token with the GPU attention backends (bf16 picks
the varlen kernel, fp32 the per-segment path), and fp32 gradients follow the SP contract. Skipped without
two GPUs."""

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

LENGTHS = (300, 1, 777, 64, 33)  # 1175 tokens: padded for sp=2, shard edge inside the 777-token sequence
BF16_LOGPROB = 5e-2


def _worker(rank, world_size):
    from collections import Counter

    import torch.distributed as dist

    import actorcore as ac
    from actorcore.kernels.attention.varlen import choose_backend
    from actorcore.parallel import ParallelContext
    from actorcore.testing.tiny_configs import build_tiny_model

    torch.cuda.set_device(rank)
    ctx = ParallelContext(sp_group=dist.new_group(list(range(world_size)), backend="nccl"))
    g = torch.Generator().manual_seed(0)
    batch = ac.pack([torch.randint(3, 131, (n,), generator=g) for n in LENGTHS]).to("cuda")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        reference = build_tiny_model("qwen2", dtype=dtype, seed=1).cuda()
        model = build_tiny_model("qwen2", dtype=dtype, seed=1).cuda()
        ac.patch_model(model, parallel=ctx)
        backend = choose_backend(torch.device("cuda"), dtype, None, 0.0,
                                 head_dim=model.model.layers[0].self_attn.head_dim)
        trace = Counter()
        out = ac.compute_logprobs(model, batch, temperature=0.8, parallel=ctx, trace=trace)
        ran = (trace["attention:actorcore_ulysses"], trace[f"varlen_attention:{backend}"])
        ref = ac.compute_logprobs(reference, batch, temperature=0.8)
        diff = max((out.log_probs - ref.log_probs).abs().max().item(), (out.entropy - ref.entropy).abs().max().item())
        grad_rel = None
        if dtype == torch.float32:
            (out.log_probs.sum() + out.entropy.sum()).backward()
            (ref.log_probs.sum() + ref.entropy.sum()).backward()
            grad_rel = 0.0
            for p, q in zip(model.parameters(), reference.parameters()):
                grad = p.grad.clone()
                dist.all_reduce(grad, group=ctx.sp_group)
                grad_rel = max(grad_rel, ((grad / world_size - q.grad).abs().max() / q.grad.abs().max()).item())
        results[str(dtype)] = {"backend": backend, "ran": ran, "layers": model.config.num_hidden_layers,
                               "diff": diff, "grad_rel": grad_rel}
    return results


def test_ulysses_sp2_nccl_matches_one_process():
    for rank, res in enumerate(run_distributed(_worker, 2)):
        for dtype, r in res.items():
            assert r["ran"] == (r["layers"], r["layers"]), f"rank {rank} {dtype}: {r['backend']} did not run"
            tol = TOL["sp_vs_single_fp32"] if dtype == "torch.float32" else BF16_LOGPROB
            assert r["diff"] <= tol, f"rank {rank} {dtype} ({r['backend']}): max |Δ| {r['diff']:.2e}"
            if r["grad_rel"] is not None:
                assert r["grad_rel"] <= TOL["grad_sp_vs_single_fp32_rel"], f"rank {rank}: grads {r['grad_rel']:.2e}"
