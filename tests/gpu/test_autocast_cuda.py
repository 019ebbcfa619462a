"""CUDA: the head's fp32 promise inside a caller's ``torch.autocast("cuda", ...)`` region, forward and backward,
per element against fp64 from the same inputs (the CPU twin is ``tests/unit/test_autocast.py``).

Shape suffixes: T tokens, D hidden, V vocab. Skipped without CUDA (and the Triton cases without triton).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import actorcore as ac
from support.head_reference import captured_final_hidden, head_fp64
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL
from support.cuda_fp32 import exact_fp32  # noqa: F401 - autouse: the fp32 reference's matmuls without TF32


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# fp32 inputs: the autocast region must change nothing; 16-bit inputs (Triton): the kernels' own tolerances.
TOLERANCES = {
    torch.float32: (TOL["head_in_autocast_vs_fp64"], TOL["head_grad_in_autocast_vs_fp64_rel"]),
    torch.bfloat16: (TOL["fused_head_bf16_vs_fp32_logits"], TOL["kernel_triton_grad_vs_reference_bf16_rel"]),
}
# (backend, input dtype, autocast dtype): the region's dtype always differs from the inputs'.
CASES = [("reference", torch.float32, torch.bfloat16), ("torch", torch.float32, torch.bfloat16),
         ("triton", torch.bfloat16, torch.float16)]


def _check(got, want, atol):
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= atol


def _check_grad(got, want, rel):
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= rel, err


@pytest.mark.parametrize("api", ["linear_logprob_entropy", "linear_logprob_loss"])
@pytest.mark.parametrize("backend,dtype,region", CASES)
def test_kernels_inside_cuda_autocast_match_fp64(api, backend, dtype, region):
    if backend == "triton":
        pytest.importorskip("triton")
    if api == "linear_logprob_loss" and backend == "reference":
        pytest.skip("covered on the CPU: the reference loss is plain autograd")
    g = torch.Generator().manual_seed(0)
    n_tok, dim, vocab = 300, 64, 1031
    hidden_TD = torch.randn(n_tok, dim, generator=g).to("cuda", dtype)
    weight_VD = (torch.randn(vocab, dim, generator=g) / dim**0.5).to("cuda", dtype)
    labels_T = torch.randint(0, vocab, (n_tok,), generator=g).cuda()
    coef_T = torch.randn(n_tok, generator=g).cuda()
    h, w = hidden_TD.clone().requires_grad_(), weight_VD.clone().requires_grad_()
    trace = Counter()
    with torch.autocast("cuda", dtype=region):
        if api == "linear_logprob_entropy":
            lp, ent = ac.linear_logprob_entropy(h, w, labels_T, temperature=0.7, backend=backend, trace=trace)
            (lp * coef_T + 0.1 * ent).sum().backward()
        else:
            out = ac.linear_logprob_loss(h, w, labels_T, lambda a, b, c: a * c + 0.1 * b, token_args=(coef_T,),
                                         temperature=0.7, backend=backend, trace=trace)
            out.loss.backward()
            lp, ent = out.logprob, out.entropy
    assert any(k.startswith(f"logprob:{backend}") for k in trace), trace  # the backend asked for ran
    h64, w64 = hidden_TD.double().requires_grad_(), weight_VD.double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.t() / 0.7, -1)
    want_lp, want_ent = logp.gather(1, labels_T[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    (want_lp * coef_T.double() + 0.1 * want_ent).sum().backward()
    atol, rel = TOLERANCES[dtype]
    _check(lp, want_lp.detach(), atol)
    _check(ent, want_ent.detach(), atol)
    _check_grad(h.grad, h64.grad, rel)
    _check_grad(w.grad, w64.grad, rel)


@pytest.mark.parametrize("api", ["compute_logprobs", "compute_loss"])
# An fp32 model in a bf16 region (the decoder rounds, the head must not); a bf16 model in a bf16 region (Triton).
@pytest.mark.parametrize("dtype,region", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_hf_head_inside_cuda_autocast_computes_fp32_from_the_decoders_hidden_states(api, dtype, region):
    if dtype != torch.float32:
        pytest.importorskip("triton")
    model = build_tiny_model("llama", dtype=dtype).cuda()
    g = torch.Generator().manual_seed(3)
    batch = ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (7, 1, 64, 33)]).to("cuda")
    coef_T = torch.randn(batch.num_real_tokens, generator=g).cuda()
    with captured_final_hidden(model) as seen, torch.autocast("cuda", dtype=region):
        if api == "compute_logprobs":
            out = ac.compute_logprobs(model, batch, temperature=0.8)
            lp, ent = out.log_probs, out.entropy
            loss = (lp * coef_T + 0.1 * ent).sum()
        else:
            out = ac.compute_loss(model, batch, lambda a, b, c: a * c + 0.1 * b, token_args=(coef_T,), temperature=0.8)
            lp, ent, loss = out.logprob, out.entropy, out.loss
        loss.backward()
    (hidden_1TD,) = seen
    h = hidden_1TD[0].detach().double().requires_grad_()
    w = model.lm_head.weight.detach().double().requires_grad_()
    want_lp, want_ent = head_fp64(h, w, batch, 0.8)
    (want_lp * coef_T.double() + 0.1 * want_ent).sum().backward()
    atol, rel = TOLERANCES[dtype]
    _check(lp, want_lp.detach(), atol)
    _check(ent, want_ent.detach(), atol)
    _check_grad(hidden_1TD.grad[0], h.grad, rel)
    _check_grad(model.lm_head.weight.grad, w.grad, rel)
