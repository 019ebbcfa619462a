"""HF route on CUDA: ``compute_loss`` runs the Triton loss-fused head and matches compute_logprobs + loss.

Skipped without CUDA or triton."""

from collections import Counter

import pytest
import torch

import actorcore as ac
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def ppo(logprob, entropy, advantages, old_logprob):
    ratio = torch.exp(logprob - old_logprob)
    return -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages) / 100 - 0.001 * entropy


def test_compute_loss_runs_the_triton_loss_fused_head():
    pytest.importorskip("triton")

    model = build_tiny_model("qwen2", dtype=torch.bfloat16).cuda()
    g = torch.Generator().manual_seed(0)
    batch = ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (7, 64, 1, 33)]).to("cuda")
    args = (torch.randn(batch.num_real_tokens, device="cuda"), -torch.rand(batch.num_real_tokens, device="cuda") * 6)
    scored = torch.ones(batch.num_real_tokens, dtype=torch.bool, device="cuda")
    scored[batch.cu_seqlens[:-1].long()] = False

    out = ac.compute_logprobs(model, batch)
    torch.where(scored, ppo(out.log_probs, out.entropy, *args), 0.0).sum().backward()
    ref = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    trace = Counter()
    fused = ac.compute_loss(model, batch, ppo, token_args=args, trace=trace)
    fused.loss.backward()
    assert trace["logprob:triton_fused_loss"] >= 1
    assert {k for k in trace if k.startswith("logprob:")} == {"logprob:triton_fused_loss"}
    torch.testing.assert_close(fused.logprob, out.log_probs.detach(), atol=TOL["fused_head_bf16_vs_fp32_logits"], rtol=0)
    for name, p in model.named_parameters():
        if name in ref:
            rel = ((p.grad.float() - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-30)).item()
            assert rel < TOL["kernel_triton_grad_vs_reference_bf16_rel"], (name, rel)
