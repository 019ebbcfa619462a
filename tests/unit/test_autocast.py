"""The head's fp32 promise holds inside a caller's ``torch.autocast`` region (CPU, bf16): kernels per element
against fp64, and the HF route's head against an fp64 head on the decoder's own hidden states.

Shape suffixes: T tokens, D hidden, V vocab. Forward and backward both run inside the region (a backward may).
"""

from __future__ import annotations

import pytest
import torch

import actorcore as ac
from actorcore.kernels.logprob import linear_logprob_entropy_vocab_shard
from support.head_reference import captured_final_hidden, head_fp64
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

ATOL = TOL["head_in_autocast_vs_fp64"]
GRAD_REL = TOL["head_grad_in_autocast_vs_fp64_rel"]
LENGTHS = (7, 1, 30, 12)


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _inputs(n_tok=45, dim=24, vocab=257):
    g = torch.Generator().manual_seed(0)
    hidden_TD = torch.randn(n_tok, dim, generator=g)
    weight_VD = torch.randn(vocab, dim, generator=g) * (3.0 / dim**0.5)
    labels_T = torch.randint(0, vocab, (n_tok,), generator=g)
    coef_T = torch.randn(n_tok, generator=g)
    return hidden_TD, weight_VD, labels_T, coef_T


def _assert_grad_close(got, want):
    assert got is not None and got.dtype == torch.float32
    rel = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert rel <= GRAD_REL, rel


def _reference(hidden_TD, weight_VD, labels_T, coef_T, temperature):
    h, w = hidden_TD.double().requires_grad_(), weight_VD.double().requires_grad_()
    logp = torch.log_softmax(h @ w.t() / temperature, -1)
    lp = logp.gather(1, labels_T[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    (lp * coef_T.double() + 0.1 * ent).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _entropy_fn(backend):
    if backend == "vocab_shard":
        return lambda h, w, y, **kw: linear_logprob_entropy_vocab_shard(h, w, y, vocab_start=0, reduce_stats=None,
                                                                        backend="torch", **kw)
    return lambda h, w, y, **kw: ac.linear_logprob_entropy(h, w, y, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["reference", "torch", "vocab_shard"])
def test_linear_logprob_entropy_inside_autocast_matches_fp64(backend):
    hidden_TD, weight_VD, labels_T, coef_T = _inputs()
    h, w = hidden_TD.clone().requires_grad_(), weight_VD.clone().requires_grad_()
    with _autocast():
        chunk_size = None if backend == "reference" else 16
        lp, ent = _entropy_fn(backend)(h, w, labels_T, temperature=0.7, chunk_size=chunk_size)
        (lp * coef_T + 0.1 * ent).sum().backward()
    want_lp, want_ent, want_gh, want_gw = _reference(hidden_TD, weight_VD, labels_T, coef_T, 0.7)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp.double(), want_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent.double(), want_ent, atol=ATOL, rtol=0)
    _assert_grad_close(h.grad, want_gh)
    _assert_grad_close(w.grad, want_gw)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_linear_logprob_loss_inside_autocast_matches_fp64(backend):
    hidden_TD, weight_VD, labels_T, coef_T = _inputs()
    h, w = hidden_TD.clone().requires_grad_(), weight_VD.clone().requires_grad_()
    with _autocast():
        out = ac.linear_logprob_loss(h, w, labels_T, lambda lp, ent, c: lp * c + 0.1 * ent, token_args=(coef_T,),
                                     temperature=0.7, backend=backend, chunk_size=16 if backend == "torch" else None)
        out.loss.backward()
    want_lp, want_ent, want_gh, want_gw = _reference(hidden_TD, weight_VD, labels_T, coef_T, 0.7)
    torch.testing.assert_close(out.logprob.double(), want_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy.double(), want_ent, atol=ATOL, rtol=0)
    want_loss = (want_lp * coef_T.double() + 0.1 * want_ent).sum()
    assert abs(out.loss.item() - want_loss.item()) <= ATOL * len(labels_T)
    _assert_grad_close(h.grad, want_gh)
    _assert_grad_close(w.grad, want_gw)


def _batch():
    g = torch.Generator().manual_seed(3)
    return ac.pack([torch.randint(3, 131, (n,), generator=g) for n in LENGTHS])


def _head_reference(model, hidden_1TD, batch, temperature):
    """fp64 head on the captured hidden states: (log-probs, entropies, fp64 leaves for their gradients)."""
    h = hidden_1TD[0].detach().double().requires_grad_()
    w = model.lm_head.weight.detach().double().requires_grad_()
    lp, ent = head_fp64(h, w, batch, temperature)
    return lp, ent, h, w


@pytest.mark.parametrize("api", ["compute_logprobs", "compute_loss"])
def test_hf_head_inside_autocast_computes_fp32_from_the_decoders_hidden_states(api):
    model = build_tiny_model("llama")
    assert not model.config.tie_word_embeddings  # the lm head's gradient is the head's alone
    batch = _batch()
    coef_T = torch.randn(batch.num_real_tokens, generator=torch.Generator().manual_seed(1))
    with captured_final_hidden(model) as seen, _autocast():
        if api == "compute_logprobs":
            out = ac.compute_logprobs(model, batch, temperature=0.8)
            log_probs, entropy = out.log_probs, out.entropy
            loss = (log_probs * coef_T + 0.1 * entropy).sum()
        else:
            out = ac.compute_loss(model, batch, lambda lp, ent, c: lp * c + 0.1 * ent, token_args=(coef_T,),
                                  temperature=0.8)
            log_probs, entropy, loss = out.logprob, out.entropy, out.loss
        loss.backward()
    (hidden_1TD,) = seen
    want_lp, want_ent, h, w = _head_reference(model, hidden_1TD, batch, 0.8)
    want_loss = (want_lp * coef_T.double() + 0.1 * want_ent).sum()
    want_loss.backward()
    assert log_probs.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(log_probs.double(), want_lp.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy.double(), want_ent.detach(), atol=ATOL, rtol=0)
    assert abs(loss.item() - want_loss.item()) <= ATOL * batch.num_real_tokens
    _assert_grad_close(hidden_1TD.grad[0], h.grad)
    _assert_grad_close(model.lm_head.weight.grad, w.grad)


def test_value_head_inside_autocast_is_fp32():
    critic = build_tiny_model("llama", task="token_classification")
    batch = _batch()
    coef_T = torch.randn(batch.num_real_tokens, generator=torch.Generator().manual_seed(1))
    with captured_final_hidden(critic) as seen, _autocast():
        values = ac.compute_values(critic, batch)
        (values * coef_T).sum().backward()
    (hidden_1TD,) = seen
    h = hidden_1TD[0].detach().double().requires_grad_()
    w = critic.score.weight.detach().double().requires_grad_()
    want = (h @ w.t())[:, 0]
    if critic.score.bias is not None:
        want = want + critic.score.bias.detach().double()
    (want * coef_T.double()).sum().backward()
    assert values.dtype == torch.float32
    torch.testing.assert_close(values.double(), want.detach(), atol=ATOL, rtol=0)
    _assert_grad_close(hidden_1TD.grad[0], h.grad)
    _assert_grad_close(critic.score.weight.grad, w.grad)


def test_megatron_value_head_inside_autocast_is_fp32(monkeypatch):
    """The Megatron route's critic head (``mcore.run.forward.values_from_hidden``) keeps the same promise: fp32 values
    and gradients inside a caller's autocast region (one rank: the TP copy is the identity)."""
    import types

    import actorcore.mcore.run.forward as mcore_forward

    monkeypatch.setattr(mcore_forward, "_all_tokens_on_every_tp_rank", lambda chunk, hidden_TD, context: hidden_TD)
    batch = ac.pack([torch.arange(n) % 17 for n in LENGTHS])
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(24, 1)
    torch.nn.init.normal_(head.weight, generator=g)
    hidden_TD = torch.randn(batch.num_tokens, 24, generator=g).requires_grad_()
    coef_T = torch.randn(batch.num_real_tokens, generator=g)
    with _autocast():
        values = mcore_forward.values_from_hidden(types.SimpleNamespace(value_head=head), hidden_TD, batch,
                                                  ac.ParallelContext())
        (values * coef_T).sum().backward()
    h = hidden_TD.detach().double().requires_grad_()
    w, b = head.weight.detach().double().requires_grad_(), head.bias.detach().double()
    want = (h @ w.t())[:, 0] + b
    (want * coef_T.double()).sum().backward()
    assert values.dtype == torch.float32
    torch.testing.assert_close(values.double(), want.detach(), atol=ATOL, rtol=0)
    _assert_grad_close(hidden_TD.grad, h.grad)
    _assert_grad_close(head.weight.grad, w.grad)
