"""GPU tests of the loss-fused head with its statistics from quack's GEMM epilogue (``kernels.logprob.quack_stats``),
per token and per gradient element against fp32 autograd, beside the Triton kernel it replaces.

Skipped without an sm90 GPU with quack and its CuTe DSL.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_logprob_triton import (  # noqa: F401 - the autouse fixture turns tf32 off for the fp32 reference
    _exact_fp32_reference,
    _inputs,
    _loss_through,
    _ppo_loss,
    _reference_loss,
    _rel_err,
)

from actorcore.kernels.logprob import linear_logprob_loss
from actorcore.testing.tolerances import TOL


def _quack_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.get_device_capability() != (9, 0):
        return "the quack statistics GEMM is taken on sm90 only"
    from actorcore.kernels.quack_runtime import quack_refusal

    return quack_refusal()


pytestmark = pytest.mark.skipif(_quack_missing() is not None, reason=str(_quack_missing()))

ATOL_BF16 = TOL["fused_head_bf16_vs_fp32_logits"]
GRAD_REL = TOL["kernel_triton_grad_vs_reference_bf16_rel"]


def _engine(loss_gemm):
    from actorcore.kernels.logprob.triton_engine import TritonEngine

    return TritonEngine(loss_gemm=loss_gemm)


# (tokens, hidden, vocab, chunk): ragged last chunks, a chunk that is not a multiple of the 128-row tile,
# a single token, and the vocabulary's 128-column tiles from 2 to 260
@pytest.mark.parametrize("n_tok,dim,vocab,chunk_size", [(3001, 256, 33280, 1000), (1, 64, 256, None),
                                                         (517, 128, 4224, 200)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_quack_statistics_match_fp32_per_token_and_gradient(n_tok, dim, vocab, chunk_size, temperature):
    hidden_TD, weight_VD, labels_T = _inputs(n_tok, dim, vocab, seed=n_tok + 3)
    g = torch.Generator(device="cuda").manual_seed(5)
    token_args = (torch.randn(n_tok, generator=g, device="cuda"), -torch.rand(n_tok, generator=g, device="cuda") * 8)
    h, w = hidden_TD.clone().requires_grad_(), weight_VD.clone().requires_grad_()
    trace = Counter()
    loss, lp, ent = _loss_through(_engine("quack"), h, w, labels_T, _ppo_loss, token_args, trace, temperature,
                                  None, chunk_size)
    loss.backward()
    lp_ref, ent_ref, gh_ref, gw_ref = _reference_loss(hidden_TD, weight_VD, labels_T, _ppo_loss, token_args,
                                                      temperature)
    torch.testing.assert_close(lp, lp_ref, atol=ATOL_BF16, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=ATOL_BF16, rtol=0)
    assert _rel_err(h.grad, gh_ref) < GRAD_REL
    assert _rel_err(w.grad, gw_ref) < GRAD_REL
    chunks = trace["logprob:triton_fused_loss"]
    assert chunks >= 1 and trace["logprob:quack_loss_stats"] == chunks  # every chunk's statistics from quack


def test_quack_path_is_as_close_to_fp32_as_triton_and_deterministic():
    """Per element no further from fp32 than the Triton kernel's path (1.5x slack), and bitwise run to run."""
    n_tok, dim, vocab = 2500, 256, 30080
    hidden_TD, weight_VD, labels_T = _inputs(n_tok, dim, vocab, seed=31)
    weight_VD = (weight_VD.float() * 6.0).to(torch.bfloat16)  # peaked softmaxes: large z - m in the fp16 store
    g = torch.Generator(device="cuda").manual_seed(6)
    token_args = (torch.randn(n_tok, generator=g, device="cuda"), -torch.rand(n_tok, generator=g, device="cuda") * 8)
    ref = _reference_loss(hidden_TD, weight_VD, labels_T, _ppo_loss, token_args, 0.7)
    errors, runs = {}, []
    for loss_gemm in ("triton", "quack", "quack"):
        h, w = hidden_TD.clone().requires_grad_(), weight_VD.clone().requires_grad_()
        loss, lp, ent = _loss_through(_engine(loss_gemm), h, w, labels_T, _ppo_loss, token_args, None, 0.7)
        loss.backward()
        got = (lp, ent, h.grad, w.grad)
        errors[loss_gemm] = [(a.double() - b.double()).abs().max().item() for a, b in zip(got, ref)]
        if loss_gemm == "quack":
            runs.append(got)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    for quack_err, triton_err, name in zip(errors["quack"], errors["triton"], ("logprob", "entropy", "h", "w")):
        assert quack_err <= 1.5 * triton_err + 1e-6, (name, quack_err, triton_err)


def test_auto_takes_quack_where_it_runs_and_the_public_default_keeps_triton():
    """``loss_gemm="auto"`` takes quack where it runs and the Triton kernel elsewhere; "quack" refuses with the
    reason; ``backend="auto"`` keeps the Triton kernel (quack's statistics measured no faster end to end)."""
    token_args = (torch.ones(300, device="cuda"), torch.zeros(300, device="cuda"))
    for vocab, expect_quack in ((4224, True), (4099, False)):
        hidden_TD, weight_VD, labels_T = _inputs(300, 64, vocab, seed=vocab)
        h, w = hidden_TD.clone().requires_grad_(), weight_VD.clone().requires_grad_()
        trace = Counter()
        loss, _, _ = _loss_through(_engine("auto"), h, w, labels_T, _ppo_loss, token_args, trace)
        loss.backward()
        assert trace["logprob:triton_fused_loss"] >= 1
        assert (trace["logprob:quack_loss_stats"] >= 1) == expect_quack, (vocab, trace)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        _loss_through(_engine("quack"), h, w, labels_T, _ppo_loss, token_args, None)
    hidden_TD, weight_VD, labels_T = _inputs(300, 64, 4224, seed=1)
    trace = Counter()
    linear_logprob_loss(hidden_TD.requires_grad_(), weight_VD, labels_T, _ppo_loss, token_args=token_args,
                        backend="auto", trace=trace).loss.backward()
    assert trace["logprob:triton_fused_loss"] >= 1 and "logprob:quack_loss_stats" not in trace
