"""CUDA with flash-linear-attention: the fla conv and gated delta rule (with ``cu_seqlens``) agree per token with
actorcore's torch reference, gradients included, and a hybrid model's ``compute_logprobs`` runs them (trace) and
agrees per token with the same model on the CPU (the torch path). Skipped without CUDA or without fla."""

from collections import Counter

import pytest
import torch

from actorcore.testing.tolerances import TOL


def _needs_cuda_and_fla():
    from actorcore.kernels.linear_attention.packed import has_fla

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not has_fla():
        pytest.skip("needs flash-linear-attention (pip install flash-linear-attention)")


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_conv_matches_torch(dtype):
    _needs_cuda_and_fla()
    from actorcore.kernels.linear_attention.packed import causal_conv1d_packed

    lengths = [1, 3, 300, 64, 1000, 2]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(lengths), 96, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(96, 4, device="cuda", dtype=dtype, generator=g).requires_grad_()
    trace = Counter()
    fast = causal_conv1d_packed(x, w, None, _cu(lengths), "silu", trace=trace)
    assert trace == {"causal_conv1d:fla": 1}
    ref = causal_conv1d_packed(x, w, None, _cu(lengths), "silu", backend="torch")
    key = "linear_kernel_fla_vs_torch_fp32" if dtype == torch.float32 else "linear_kernel_fla_vs_torch_bf16_rel"
    assert _rel(fast, ref) <= TOL[key]
    grad = torch.randn_like(fast)
    for a, b in zip(torch.autograd.grad(fast, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        assert _rel(a, b) <= TOL[key]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_delta_rule_matches_torch(dtype):
    _needs_cuda_and_fla()
    from actorcore.kernels.linear_attention.packed import gated_delta_rule_packed

    lengths = [1, 3, 300, 64, 1000, 2]
    T = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k = (torch.randn(T, 2, 64, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    v = torch.randn(T, 4, 64, device="cuda", dtype=dtype, generator=g)
    decay = -torch.rand(T, 4, device="cuda", generator=g) * 0.3
    beta = torch.rand(T, 4, device="cuda", generator=g).to(dtype)
    from actorcore.kernels.linear_attention.packed import fla_delta_rule_refusal

    with torch.no_grad():  # forward only: fla runs wherever it is installed
        trace = Counter()
        fast = gated_delta_rule_packed(q, k, v, decay, beta, _cu(lengths), trace=trace)
        assert trace == {"gated_delta_rule:fla": 1}
        ref = gated_delta_rule_packed(q, k, v, decay, beta, _cu(lengths), backend="torch")
        assert _rel(fast, ref) <= TOL["linear_kernel_fla_vs_torch_bf16_rel"]
    inputs = [x.requires_grad_() for x in (q, k, v, decay, beta)]
    trace = Counter()
    fast = gated_delta_rule_packed(*inputs, _cu(lengths), trace=trace)
    if fla_delta_rule_refusal(q.device):  # fla would refuse its own backward here: auto trains on torch
        assert trace == {"gated_delta_rule:torch": 1}
        return
    assert trace == {"gated_delta_rule:fla": 1}
    ref = gated_delta_rule_packed(*inputs, _cu(lengths), backend="torch")
    grad = torch.randn_like(fast)
    for a, b in zip(torch.autograd.grad(fast, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        assert _rel(a, b) <= TOL["linear_kernel_fla_vs_torch_bf16_rel"]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_hybrid_model_runs_fla_and_matches_cpu(model_type):
    _needs_cuda_and_fla()
    import actorcore as ac
    from actorcore.testing.tiny_configs import build_tiny_model

    g = torch.Generator().manual_seed(2)
    batch = ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (1, 70, 5, 200, 9)])
    dims = dict(linear_key_head_dim=32, linear_value_head_dim=64)  # Triton-friendly head dims
    cpu = build_tiny_model(model_type, **dims)
    gpu = build_tiny_model(model_type, attn_implementation="sdpa", **dims).cuda()
    trace = Counter()
    with torch.no_grad():
        want = ac.compute_logprobs(cpu, batch)
        got = ac.compute_logprobs(gpu, batch.to("cuda"), trace=trace)
    layers = cpu.config.layer_types.count("linear_attention")
    assert trace["linear_attention:actorcore_packed"] == layers
    assert trace["causal_conv1d:fla"] == layers and trace["gated_delta_rule:fla"] == layers
    assert (got.log_probs.cpu() - want.log_probs).abs().max().item() <= TOL["hybrid_fla_vs_cpu_fp32"]
    assert (got.entropy.cpu() - want.entropy).abs().max().item() <= TOL["hybrid_fla_vs_cpu_fp32"]


def test_torch_delta_rule_blocks_on_cuda_match_whole_pack_on_cpu():
    """The torch backend's blocks path (hand-written backward) on CUDA against the whole-pack autograd path on the
    CPU, fp32 (no TF32), per element: output and the gradients of q, k, v, g, beta. Needs CUDA only."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from actorcore.kernels.linear_attention.delta_rule_chunks import delta_rule_blocks, delta_rule_whole_pack

    lengths = [1, 3, 300, 64, 0, 1000, 2]
    T = sum(lengths)
    g = torch.Generator().manual_seed(2)
    cpu = [torch.randn(T, 2, 64, generator=g), torch.randn(T, 2, 64, generator=g), torch.randn(T, 4, 64, generator=g),
           -torch.rand(T, 4, generator=g) * 0.3, torch.rand(T, 4, generator=g)]
    cpu = [x.requires_grad_() for x in cpu]
    cuda = [x.detach().cuda().requires_grad_() for x in cpu]
    w = torch.randn(T, 4, 64, generator=g)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        got = delta_rule_blocks(*cuda, _cu(lengths), True, 0.125, block_tokens=256)
        got_grads = torch.autograd.grad((got * w.cuda()).sum(), cuda)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert type(got.grad_fn).__name__ == "_DeltaRuleBlocksBackward"
    want = delta_rule_whole_pack(*cpu, _cu(lengths).cpu(), True, 0.125)
    want_grads = torch.autograd.grad((want * w).sum(), cpu)
    assert (got.cpu() - want).abs().max().item() <= TOL["linear_kernel_vs_reference_fp32"]
    for a, b in zip(got_grads, want_grads):
        assert _rel(a.cpu(), b) <= TOL["linear_kernel_grad_vs_reference_fp32_rel"]
