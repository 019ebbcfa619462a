"""``linear_logprob_loss``: a token-wise loss of (log-prob, entropy), its gradient formed chunk by chunk.

Shape suffixes: T tokens, D hidden, V vocab. On the CPU the chunked torch engine runs the chunk-by-chunk
path; every result is compared per element with autograd through the fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

from collections import Counter

from actorcore.kernels.logprob import linear_logprob_loss
from actorcore.testing.tolerances import TOL

ATOL = TOL["kernel_chunked_vs_reference_fp32"]
GRAD_REL = TOL["kernel_chunked_grad_vs_reference_fp32_rel"]


def _inputs(n_tok=45, dim=24, vocab=257, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden_TD = torch.randn(n_tok, dim, generator=g, dtype=dtype)
    weight_VD = torch.randn(vocab, dim, generator=g, dtype=dtype) * (2.0 / dim**0.5)
    labels_T = torch.randint(0, vocab, (n_tok,), generator=g)
    advantages_T = torch.randn(n_tok, generator=g, dtype=dtype)
    old_logprob_T = -torch.rand(n_tok, generator=g, dtype=dtype) * 6
    mask_T = (torch.rand(n_tok, generator=g) > 0.2).to(dtype)
    return hidden_TD, weight_VD, labels_T, (advantages_T, old_logprob_T, mask_T)


def ppo_loss(logprob, entropy, advantages, old_logprob, mask, clip=0.2, ent_coef=0.01):
    """PPO clipped objective with an entropy bonus, token-mean over the batch's masked tokens."""
    ratio = torch.exp(logprob - old_logprob)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    per_token = -surrogate - (ent_coef * entropy if entropy is not None else 0.0)
    return per_token * mask / 37.0  # a fixed normaliser: the batch's token count, known up front


def _grads(backend, scale=1.0, chunk_size=None, trace=None, **kw):
    hidden_TD, weight_VD, labels_T, token_args = _inputs(**kw.pop("shape", {}))
    h = hidden_TD.clone().requires_grad_()
    w = weight_VD.clone().requires_grad_()
    out = linear_logprob_loss(h, w, labels_T, ppo_loss, token_args=token_args, backend=backend,
                              chunk_size=chunk_size, trace=trace, **kw)
    (out.loss * scale).backward()
    return out, h.grad, w.grad


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("chunk_size", [None, 7, 16])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (0.7, 3.0)])
@pytest.mark.parametrize("entropy", [True, False])
def test_loss_and_grads_match_reference(chunk_size, temperature, softcap, entropy):
    kw = dict(temperature=temperature, softcap=softcap, entropy=entropy)
    trace = Counter()
    out, gh, gw = _grads("torch", scale=2.5, chunk_size=chunk_size, trace=trace, **kw)
    # the chunked engine ran (a forward and a backward per chunk), not the reference
    chunks = -(-45 // chunk_size) if chunk_size else 1
    assert trace == {"logprob:torch_chunk": 2 * chunks, "logprob:torch_chunk_rows": 2 * 45}
    ref, gh_ref, gw_ref = _grads("reference", scale=2.5, **kw)
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logprob, ref.logprob, atol=ATOL, rtol=0)
    if entropy:
        torch.testing.assert_close(out.entropy, ref.entropy, atol=ATOL, rtol=0)
    else:
        assert out.entropy is None and ref.entropy is None
    assert _rel(gh, gh_ref) < GRAD_REL
    assert _rel(gw, gw_ref) < GRAD_REL


def test_loss_fn_is_called_once_per_chunk_plus_the_check():
    hidden_TD, weight_VD, labels_T, token_args = _inputs(n_tok=40)
    calls = []

    def loss_fn(logprob, entropy, *args):
        calls.append(logprob.shape[0])
        return ppo_loss(logprob, entropy, *args)

    linear_logprob_loss(hidden_TD.requires_grad_(), weight_VD, labels_T, loss_fn, token_args=token_args,
                        backend="torch", chunk_size=16)
    assert calls == [16, 8, 8, 16, 16, 8]  # first chunk whole and in halves (the check), then each chunk


def test_grads_match_finite_differences_fp64():
    hidden_TD, weight_VD, labels_T, token_args = _inputs(n_tok=9, dim=5, vocab=13, dtype=torch.float64)

    def f(h, w):
        return linear_logprob_loss(h, w, labels_T, ppo_loss, token_args=token_args, temperature=0.8,
                                   backend="torch", chunk_size=4).loss

    h, w = hidden_TD.clone().requires_grad_(), weight_VD.clone().requires_grad_()
    f(h, w).backward()
    eps = 1e-6
    for x, grad in ((hidden_TD, h.grad), (weight_VD, w.grad)):
        for idx in [(0, 0), (3, 2), (x.shape[0] - 1, x.shape[1] - 1)]:
            plus, minus = x.clone(), x.clone()
            plus[idx] += eps
            minus[idx] -= eps
            args = (plus, weight_VD) if x is hidden_TD else (hidden_TD, plus)
            args_m = (minus, weight_VD) if x is hidden_TD else (hidden_TD, minus)
            numeric = (f(*args) - f(*args_m)).item() / (2 * eps)
            assert abs(numeric - grad[idx].item()) < TOL["finite_difference_fp64"], (idx, numeric, grad[idx].item())


def test_second_backward_is_refused():
    hidden_TD, weight_VD, labels_T, token_args = _inputs()
    h = hidden_TD.clone().requires_grad_()
    out = linear_logprob_loss(h, weight_VD, labels_T, ppo_loss, token_args=token_args, backend="torch")
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        out.loss.backward()


def test_frozen_weight_and_no_grad():
    hidden_TD, weight_VD, labels_T, token_args = _inputs()
    h = hidden_TD.clone().requires_grad_()
    out = linear_logprob_loss(h, weight_VD, labels_T, ppo_loss, token_args=token_args, backend="torch")
    out.loss.backward()
    assert h.grad is not None and weight_VD.grad is None
    with torch.no_grad():
        out2 = linear_logprob_loss(h, weight_VD, labels_T, ppo_loss, token_args=token_args, backend="torch")
    assert not out2.loss.requires_grad
    torch.testing.assert_close(out2.loss, out.loss.detach(), atol=0, rtol=0)


NO_GRAD_PATH_LOSSES = {
    "detached": lambda lp, ent: lp.detach() * 2.0,
    "constant": lambda lp, ent: torch.ones_like(lp),
    "from_a_copy": lambda lp, ent: torch.tensor(lp.tolist()) - ent.detach(),
}


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("name", sorted(NO_GRAD_PATH_LOSSES))
def test_loss_without_a_gradient_path_is_refused(backend, name):
    """Plain autograd raises on such a loss's backward; the fused head must not train with zero gradients."""
    hidden_TD, weight_VD, labels_T, _ = _inputs()
    h = hidden_TD.clone().requires_grad_()
    with pytest.raises(ValueError, match="does not depend on the log-probs or entropies with gradient"):
        linear_logprob_loss(h, weight_VD, labels_T, NO_GRAD_PATH_LOSSES[name], backend=backend)
    with torch.no_grad():  # evaluating such a loss is fine
        out = linear_logprob_loss(h, weight_VD, labels_T, NO_GRAD_PATH_LOSSES[name], backend=backend)
    assert not out.loss.requires_grad


def test_loss_with_a_gradient_path_in_some_chunks_only_trains():
    """Like plain autograd: chunks whose losses are constants contribute zero gradient, the others theirs."""
    hidden_TD, weight_VD, labels_T, _ = _inputs()
    first_half = (torch.arange(hidden_TD.shape[0]) < 16).float()

    def loss_fn(lp, ent, keep):
        return lp * keep if bool(keep.any()) else torch.zeros_like(lp)

    h = hidden_TD.clone().requires_grad_()
    linear_logprob_loss(h, weight_VD, labels_T, loss_fn, token_args=(first_half,), backend="torch",
                        chunk_size=16).loss.backward()
    assert h.grad[:16].abs().sum() > 0 and torch.equal(h.grad[16:], torch.zeros_like(h.grad[16:]))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_non_token_wise_loss_is_refused(backend):
    hidden_TD, weight_VD, labels_T, _ = _inputs()
    with pytest.raises(ValueError, match="not token-wise"):
        linear_logprob_loss(hidden_TD, weight_VD, labels_T, lambda lp, ent: lp - lp.mean(), backend=backend)


@pytest.mark.parametrize(
    "case,match",
    [
        ("scalar_loss", "one loss per token"),
        ("short_arg", "one row per token"),
        ("arg_requires_grad", "requires grad"),
        ("not_callable", "must be a callable"),
        ("bad_backend", "unknown backend"),
    ],
)
def test_bad_input_raises_clear_error(case, match):
    hidden_TD, weight_VD, labels_T, token_args = _inputs()
    loss_fn, kw = ppo_loss, dict(token_args=token_args)
    if case == "scalar_loss":
        loss_fn, kw = (lambda lp, ent: lp.sum()), {}
    elif case == "short_arg":
        kw = dict(token_args=(token_args[0][:-1], *token_args[1:]))
    elif case == "arg_requires_grad":
        kw = dict(token_args=(token_args[0].clone().requires_grad_(), *token_args[1:]))
    elif case == "not_callable":
        loss_fn = "ppo"
    elif case == "bad_backend":
        kw["backend"] = "cuda"
    with pytest.raises(ValueError, match=match):
        linear_logprob_loss(hidden_TD, weight_VD, labels_T, loss_fn, **kw)


IN_PLACE_LOSSES = {
    "logprob.mul_": (lambda lp, ent, adv: lp.mul_(adv), "the log-probs"),
    "entropy.clamp_": (lambda lp, ent, adv: lp - ent.clamp_(max=1.0), "the entropies"),
    "writes into token_args": (lambda lp, ent, adv: lp * adv.mul_(2.0), "token_args\\[0\\]"),
}


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("name", sorted(IN_PLACE_LOSSES))
def test_in_place_loss_is_diagnosed_as_such_and_leaves_the_callers_tensors(backend, name):
    hidden_TD, weight_VD, labels_T, (advantages_T, *_) = _inputs()
    loss_fn, what = IN_PLACE_LOSSES[name]
    before = advantages_T.clone()
    with pytest.raises(ValueError, match=f"modifies its inputs in place \\({what}\\)"):
        linear_logprob_loss(hidden_TD.requires_grad_(), weight_VD, labels_T, loss_fn, token_args=(advantages_T,),
                            backend=backend)
    assert torch.equal(advantages_T, before)


def test_bare_tensor_token_args_asks_for_a_tuple():
    hidden_TD, weight_VD, labels_T, (advantages_T, *_) = _inputs()
    with pytest.raises(ValueError, match=r"got a bare tensor; .*token_args=\(advantages,\)"):
        linear_logprob_loss(hidden_TD, weight_VD, labels_T, lambda lp, ent, a: lp * a, token_args=advantages_T)


def test_non_callable_loss_fn_is_refused_before_any_other_check():
    with pytest.raises(ValueError, match="loss_fn must be a callable"):
        linear_logprob_loss("not a tensor", None, None, "ppo")


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_loss_under_inference_mode_evaluates(backend):
    hidden_TD, weight_VD, labels_T, token_args = _inputs()
    with torch.inference_mode():
        out = linear_logprob_loss(hidden_TD, weight_VD, labels_T, ppo_loss, token_args=token_args, backend=backend)
    ref = linear_logprob_loss(hidden_TD, weight_VD, labels_T, ppo_loss, token_args=token_args, backend="reference")
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=0)


def test_masked_token_loss_drops_the_rows_it_does_not_keep():
    """A loss that is nonzero at zero inputs (an entropy bonus) gives 0 on the rows the keep mask drops; a result
    that is not one loss per row passes through for ``linear_logprob_loss`` to refuse."""
    from actorcore.kernels.logprob.fused_loss import masked_token_loss

    def bonus(logprob, entropy, weight):
        return logprob * weight - 0.01 * entropy

    keep = torch.tensor([True, False, True])
    logprob, entropy, weight = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([4.0, 5.0, 6.0]), torch.zeros(3)
    got = masked_token_loss(bonus)(logprob, entropy, keep, weight)
    unmasked = bonus(logprob, entropy, weight)
    assert bool((unmasked != 0).all())
    assert got[1] == 0 and torch.equal(got[[0, 2]], unmasked[[0, 2]])
    assert masked_token_loss(lambda lp, ent: lp.sum())(logprob, entropy, keep).shape == ()
    hidden_TD, weight_VD, labels_T, _ = _inputs()
    with pytest.raises(ValueError, match="one loss per token"):
        linear_logprob_loss(hidden_TD, weight_VD, labels_T, masked_token_loss(lambda lp, ent: lp.sum()),
                            token_args=(torch.ones(labels_T.shape[0], dtype=torch.bool),))
