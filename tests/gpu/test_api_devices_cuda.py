"""CUDA: inputs on another device than the model are moved where the API promises it, refused where not.

Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import actorcore as ac
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_cpu_batch_and_cpu_token_args_are_moved_to_the_models_device():
    model = build_tiny_model("llama").cuda()
    g = torch.Generator().manual_seed(0)
    batch = ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (5, 9)])
    advantages = torch.randn(batch.num_real_tokens, generator=g)
    with torch.no_grad():
        on_cpu = ac.compute_logprobs(model, batch)
        on_gpu = ac.compute_logprobs(model, batch.to("cuda"))
        loss = ac.compute_loss(model, batch, lambda lp, ent, a: lp * a, token_args=(advantages,))
    assert on_cpu.log_probs.is_cuda
    torch.testing.assert_close(on_cpu.log_probs, on_gpu.log_probs, atol=TOL["packed_vs_hf_fp32"], rtol=0)
    torch.testing.assert_close(loss.logprob, on_gpu.log_probs, atol=TOL["packed_vs_hf_fp32"], rtol=0)


def test_kernel_inputs_on_two_devices_are_refused():
    hidden_TD, weight_VD, labels_T = torch.randn(4, 8, device="cuda"), torch.randn(11, 8), torch.zeros(4).long()
    with pytest.raises(ValueError, match="must be on one device.*move them"):
        ac.linear_logprob_entropy(hidden_TD, weight_VD, labels_T)
