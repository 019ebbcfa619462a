"""HF route: ``compute_loss`` (loss-fused head) against ``compute_logprobs`` followed by the same loss, per
parameter gradient and per token (tiny fp32 models). Both sides run the same decoder, so the architectures are
the representative set (head transforms, tied head, MoE, hybrid, ...), not every registered one."""

import pytest
import torch

import actorcore as ac
from actorcore.testing.tiny_configs import REPRESENTATIVE_ARCHS, build_tiny_model
from actorcore.testing.tolerances import TOL

LENGTHS = [1, 2, 23, 5, 40, 9]


def _batch_and_args(seed=0, vocab=131):
    g = torch.Generator().manual_seed(seed)
    batch = ac.pack([torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS])
    n_tok = sum(LENGTHS)
    advantages = torch.randn(n_tok, generator=g)
    old_logprob = -torch.rand(n_tok, generator=g) * 6
    weight = (torch.rand(n_tok, generator=g) > 0.3).float() / 50.0
    return batch, (advantages, old_logprob, weight)


def ppo(logprob, entropy, advantages, old_logprob, weight):
    ratio = torch.exp(logprob - old_logprob)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    return (-surrogate - 0.01 * entropy) * weight


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", sorted(REPRESENTATIVE_ARCHS))
def test_compute_loss_equals_logprobs_then_loss(model_type):
    model = build_tiny_model(model_type)
    batch, args = _batch_and_args()
    scored = torch.ones(batch.num_real_tokens, dtype=torch.bool)
    scored[batch.cu_seqlens[:-1].long()] = False  # sequence starts score nothing

    out = ac.compute_logprobs(model, batch, temperature=0.8)
    ref_loss = torch.where(scored, ppo(out.log_probs, out.entropy, *args), 0.0).sum()
    ref_loss.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    fused = ac.compute_loss(model, batch, ppo, token_args=args, temperature=0.8)
    fused.loss.backward()
    grads = _grads(model)

    assert abs(fused.loss.item() - ref_loss.item()) <= TOL["packed_vs_hf_fp32"] * max(1.0, abs(ref_loss.item()))
    assert (fused.logprob - out.log_probs.detach()).abs().max() <= TOL["packed_vs_hf_fp32"]
    assert (fused.entropy - out.entropy.detach()).abs().max() <= TOL["packed_vs_hf_fp32"]
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        rel = ((grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        assert rel <= TOL["grad_packed_vs_hf_fp32_rel"], (name, rel)


def test_compute_loss_ignores_token_args_at_sequence_starts():
    model = build_tiny_model("qwen2")
    batch, args = _batch_and_args(seed=1)
    base = ac.compute_loss(model, batch, ppo, token_args=args).loss
    poisoned = [a.clone() for a in args]
    for a in poisoned:
        a[batch.cu_seqlens[:-1].long()] = 1e6
    assert ac.compute_loss(model, batch, ppo, token_args=poisoned).loss.item() == base.item()


def test_compute_loss_refusals():
    model = build_tiny_model("llama")
    batch, args = _batch_and_args()
    with pytest.raises(ValueError, match="one row per token"):
        ac.compute_loss(model, batch, ppo, token_args=(args[0][:-1], *args[1:]))
    with pytest.raises(ValueError, match="one loss per token"):
        ac.compute_loss(model, batch, lambda lp, ent: lp.sum())
    with pytest.raises(ValueError, match="not token-wise"):
        ac.compute_loss(model, batch, lambda lp, ent: lp - lp.mean())
    with pytest.raises(ValueError, match="does not depend on the log-probs or entropies with gradient"):
        ac.compute_loss(model, batch, lambda lp, ent: lp.detach() * 2)
    with pytest.raises(ValueError, match="modifies its inputs in place"):
        ac.compute_loss(model, batch, lambda lp, ent, adv: lp.mul_(adv), token_args=args[:1])
    with pytest.raises(ValueError, match=r"token_args=\(advantages,\)"):
        ac.compute_loss(model, batch, ppo, token_args=args[0])
    with pytest.raises(ValueError, match="sequence parallelism"):
        ac.compute_loss(model, batch, ppo, token_args=args, parallel=_FakeSP())


class _FakeSP:
    sp_size = 2
    sp_rank = 0
