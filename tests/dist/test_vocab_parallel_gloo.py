"""Vocabulary-parallel head on gloo (2 ranks, each holding half of a 1001-row vocabulary): per-token log-probs
and entropies on every rank, each rank's weight-shard gradient, and the summed partial hidden gradients all equal
the unsharded fp32 reference. One spawn runs every case (process start-up is the cost)."""

import torch

from actorcore.kernels.logprob import linear_logprob_entropy_reference
from actorcore.parallel.vocab_parallel import linear_logprob_entropy_vocab_parallel
from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

CASES = ((0.7, None), (1.0, 3.0))  # (temperature, softcap)
TOKENS, DIM, VOCAB = 37, 48, 1001


def _problem():
    """Hidden states, head weight, labels and the per-token output gradients of every case."""
    g = torch.Generator().manual_seed(21)
    hidden_TD = torch.randn(TOKENS, DIM, generator=g)
    weight_VD = torch.randn(VOCAB, DIM, generator=g) * (3.0 / DIM**0.5)
    labels_T = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    return hidden_TD, weight_VD, labels_T, torch.randn(TOKENS, generator=g), torch.randn(TOKENS, generator=g)


def _shard(rank, world_size):
    per = -(-VOCAB // world_size)
    return rank * per, min(VOCAB, (rank + 1) * per)


def _worker(rank, world_size):
    import torch.distributed as dist

    hidden_TD, weight_VD, labels_T, g_lp_T, g_ent_T = _problem()
    lo, hi = _shard(rank, world_size)
    out = []
    for temperature, softcap in CASES:
        h = hidden_TD.clone().requires_grad_()
        w = weight_VD[lo:hi].clone().requires_grad_()
        lp, ent = linear_logprob_entropy_vocab_parallel(
            h, w, labels_T, vocab_start=lo, tp_group=dist.group.WORLD, temperature=temperature, softcap=softcap,
            backend="auto", chunk_size=10)
        ((lp * g_lp_T).sum() + (ent * g_ent_T).sum()).backward()
        out.append({"lp": lp.detach(), "ent": ent.detach(), "grad_h": h.grad, "grad_w": w.grad, "lo": lo, "hi": hi})
    return out


def _rel_err(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def test_vocab_parallel_gloo_matches_unsharded_reference():
    per_rank = run_distributed(_worker, world_size=2)
    hidden_TD, weight_VD, labels_T, g_lp_T, g_ent_T = _problem()
    atol, grad_rel = TOL["kernel_chunked_vs_reference_fp32"], TOL["kernel_chunked_grad_vs_reference_fp32_rel"]
    for case, (temperature, softcap) in enumerate(CASES):
        results = [r[case] for r in per_rank]
        h = hidden_TD.clone().requires_grad_()
        w = weight_VD.clone().requires_grad_()
        lp_ref, ent_ref = linear_logprob_entropy_reference(h, w, labels_T, temperature=temperature, softcap=softcap)
        ((lp_ref * g_lp_T).sum() + (ent_ref * g_ent_T).sum()).backward()
        for res in results:  # every rank holds the full per-token outputs
            torch.testing.assert_close(res["lp"], lp_ref.detach(), atol=atol, rtol=0)
            torch.testing.assert_close(res["ent"], ent_ref.detach(), atol=atol, rtol=0)
            assert _rel_err(res["grad_w"], w.grad[res["lo"]: res["hi"]]) <= grad_rel
        # partial grad_hidden per rank: the caller's all-reduce (a sum) gives the full gradient
        assert _rel_err(sum(r["grad_h"] for r in results), h.grad) <= grad_rel
        assert (results[0]["grad_h"] - h.grad).abs().max() > 1e-3  # a rank alone holds only a part
