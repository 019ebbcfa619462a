"""CUDA: the varlen attention backends agree with the per-segment reference, and compute_logprobs on a GPU
model picks them and equals the padded HF path. Skipped without CUDA."""

from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _qkv(lengths, n=8, k=2, h=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)
    mk = lambda heads: torch.randn(t, heads, h, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return mk(n), mk(k), mk(k), cu


@pytest.mark.parametrize("window", [None, 17])
def test_torch_varlen_matches_segments(window):
    from actorcore.kernels.attention.varlen import _has_torch_varlen, varlen_causal_attention

    if not _has_torch_varlen():
        pytest.skip("torch.nn.attention.varlen is not available")
    lengths = [1, 2, 300, 77, 1024, 5]
    q, k, v, cu = _qkv(lengths)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    trace = Counter()
    fast = varlen_causal_attention(q, k, v, cu, max(lengths), sliding_window=window, backend="torch_varlen",
                                   trace=trace)
    assert trace == {"varlen_attention:torch_varlen": 1}
    ref = varlen_causal_attention(q.float(), k.float(), v.float(), cu, max(lengths), sliding_window=window,
                                  backend="segments")
    assert (fast.float() - ref).abs().max().item() < 2e-2
    grad = torch.randn_like(fast)
    gq, gk, gv = torch.autograd.grad(fast, (q, k, v), grad)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad.float())
    for a, b in ((gq, rq), (gk, rk), (gv, rv)):
        assert ((a.float() - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_logprobs_on_cuda_matches_padded(dtype):
    import actorcore as ac
    from actorcore.kernels.attention.varlen import choose_backend
    from actorcore.testing.reference import reference_logprobs, right_padded
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("qwen2", dtype=dtype, attn_implementation="sdpa").cuda()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 131, (n,), generator=g) for n in (1, 2, 64, 300, 17)]
    ids, mask = right_padded(seqs)
    batch = ac.pack_padded(ids, mask).to("cuda")
    backend = choose_backend(torch.device("cuda"), dtype, None, 0.0, head_dim=model.model.layers[0].self_attn.head_dim)
    trace = Counter()
    with torch.no_grad():
        out = ac.compute_logprobs(model, batch, temperature=0.7, trace=trace)
        ref_lp, ref_ent = reference_logprobs(model, ids.cuda(), mask.cuda(), 0.7)
    layers = model.config.num_hidden_layers
    assert trace["attention:actorcore_packed"] == layers
    assert trace[f"varlen_attention:{backend}"] == layers
    if dtype == torch.float32:
        assert backend == "segments"
        tol = 1e-4
    else:
        assert backend in ("flash_attn", "torch_varlen")
        tol = 5e-2  # bf16 attention kernels differ in rounding; the head itself is fp32 in both
    assert (out.log_probs - ref_lp).abs().max().item() < tol
    assert (out.entropy - ref_ent).abs().max().item() < tol


def _fsdp_cuda_worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import actorcore as ac
    from actorcore.testing.tiny_configs import build_tiny_model

    torch.cuda.set_device(rank)
    mesh = DeviceMesh.from_group(dist.new_group(list(range(world_size)), backend="nccl"), "cuda")
    g = torch.Generator().manual_seed(1)
    batch = ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (5, 1, 300)]).to("cuda")
    reference = build_tiny_model("qwen2", seed=2).cuda()
    model = build_tiny_model("qwen2", seed=2).cuda()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out = ac.compute_logprobs(model, batch)
    out.log_probs.sum().backward()
    ref = ac.compute_logprobs(reference, batch)
    ref.log_probs.sum().backward()
    grad_rel = max(((p.grad.full_tensor() - q.grad).abs().max() / q.grad.abs().max()).item()
                   for p, q in zip(model.parameters(), reference.parameters()))
    return (out.log_probs - ref.log_probs).abs().max().item(), grad_rel


def test_fsdp2_on_cuda_runs_as_the_models_forward():
    """FSDP2 with a CUDA mesh: compute_logprobs enters through the root forward (torch 2.11's FSDP2 root
    pre-forward needs an argument) and equals the unsharded model."""
    from actorcore.testing.distributed import run_distributed

    diff, grad_rel = run_distributed(_fsdp_cuda_worker, 1)[0]
    assert diff <= 1e-5 and grad_rel <= 1e-5
