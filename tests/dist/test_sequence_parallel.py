"""Ulysses SP on gloo (2 and 4 processes): per-token log-probs, entropy and values equal one process's, and
parameter gradients averaged over the SP group equal one process's (the gradient contract).

Lengths 7 + 12 + 4 = 23 tokens: not a multiple of 2 or 4 (a padding segment is added), and the shard edges
(12 at sp=2; 6, 12, 18 at sp=4) fall inside sequences, so a shard's last token is scored against the next
shard's first. The tiny configs have 4 heads and 2 kv heads: sp=4 replicates kv heads. Each spawned run
checks several things at once to keep process start-up (the dominant cost) low.
"""

from collections import Counter

import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL
from support.sequence_parallel import LENGTHS, grad_rel_diffs, loss_weights, sp_sequences


ARCHS = ("llama", "gemma2")  # gemma2: sliding window, attention softcap, GeGLU, tied head
SP2_ARCHS = ARCHS + ("qwen3_moe", "gpt_oss", "glm4_moe", "granite")  # MoE MLPs are token-wise; gpt_oss: per-head
# sinks split over ranks; glm4_moe: partial RoPE; granite: attention multiplier as the attention scale


def _check_arch(model_type, ctx):
    import actorcore as ac
    from actorcore.testing.tiny_configs import build_tiny_model, has_critic_class

    batch = ac.pack(sp_sequences())
    w = loss_weights(batch.num_tokens)
    result = {}
    # Actor: the reference model stays unpatched in the same process (patches are per instance).
    reference, actor = build_tiny_model(model_type, seed=3), build_tiny_model(model_type, seed=3)
    handle = ac.patch_model(actor, parallel=ctx)
    ref = ac.compute_logprobs(reference, batch, temperature=0.7)
    trace = Counter()
    out = ac.compute_logprobs(actor, batch, temperature=0.7, parallel=ctx, trace=trace)
    result["ulysses_calls"] = trace["attention:actorcore_ulysses"]
    result["num_layers"] = actor.config.num_hidden_layers
    result["logprob"] = (out.log_probs - ref.log_probs).abs().tolist()
    result["entropy"] = (out.entropy - ref.entropy).abs().tolist()
    ((w[0] * ref.log_probs).sum() + (w[1] * ref.entropy).sum()).backward()
    ((w[0] * out.log_probs).sum() + (w[1] * out.entropy).sum()).backward()
    result["actor_grads"] = grad_rel_diffs(reference, actor, ctx.sp_group, ctx.sp_size)
    # The reference model is untouched by the actor's patch.
    result["reference_impl"] = reference.config._attn_implementation
    handle.revert()
    result["reverted_impl"] = actor.config._attn_implementation

    # Critic (where transformers has a ...ForTokenClassification for the architecture).
    if not has_critic_class(model_type):
        result["value"], result["critic_grads"] = [0.0] * sum(LENGTHS), {}
        return result
    reference = build_tiny_model(model_type, task="token_classification", seed=4)
    critic = build_tiny_model(model_type, task="token_classification", seed=4)
    ac.patch_model(critic, parallel=ctx)
    ref_v = ac.compute_values(reference, batch)
    out_v = ac.compute_values(critic, batch, parallel=ctx)
    result["value"] = (out_v - ref_v).abs().tolist()
    (w[2] * ref_v).sum().backward()
    (w[2] * out_v).sum().backward()
    result["critic_grads"] = grad_rel_diffs(reference, critic, ctx.sp_group, ctx.sp_size)
    return result


def _bypass_is_caught(model_type, ctx):
    """Simulate a transformers version that ignores the patched implementation: the self-check must fire."""
    import actorcore as ac
    from actorcore.hf.features.attention import PackingNotAppliedError
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model(model_type)
    ac.patch_model(model, parallel=ctx)
    model.config.__dict__["_attn_implementation_internal"] = "eager"  # behind the patch's back
    try:
        ac.compute_logprobs(model, ac.pack(sp_sequences()), parallel=ctx)
    except PackingNotAppliedError as exc:
        return str(exc)
    return None


def _unpatched_is_refused(model_type, ctx):
    import actorcore as ac
    from actorcore.testing.tiny_configs import build_tiny_model

    try:
        ac.compute_logprobs(build_tiny_model(model_type), ac.pack(sp_sequences()), parallel=ctx)
    except ValueError as exc:
        return str(exc)
    return None


def _sp_worker(rank, world_size, archs):
    import torch.distributed as dist

    from actorcore.parallel import ParallelContext

    ctx = ParallelContext(sp_group=dist.new_group(list(range(world_size))))
    results = {arch: _check_arch(arch, ctx) for arch in archs}
    results["bypass"] = _bypass_is_caught(archs[0], ctx)
    results["unpatched"] = _unpatched_is_refused(archs[0], ctx)
    return results


def _assert_results(results, sp_size, archs):
    tol, grad_tol = TOL["sp_vs_single_fp32"], TOL["grad_sp_vs_single_fp32_rel"]
    for rank, res in enumerate(results):
        for arch in archs:
            r = res[arch]
            where = f"sp={sp_size} rank {rank} {arch}"
            assert r["ulysses_calls"] == r["num_layers"], f"{where}: Ulysses attention did not run in every layer"
            for key in ("logprob", "entropy", "value"):
                assert len(r[key]) == sum(LENGTHS)
                worst = max(r[key])
                assert worst <= tol, f"{where}: {key} max |Δ| {worst:.2e} at token {r[key].index(worst)}"
            for key in ("actor_grads", "critic_grads"):
                for name, rel in r[key].items():
                    assert rel <= grad_tol, f"{where}: {key} {name} relative diff {rel:.2e}"
            assert r["reference_impl"] == "eager" and r["reverted_impl"] == "eager"
        assert res["bypass"] and "bypassed actorcore's attention" in res["bypass"], res["bypass"]
        assert res["unpatched"] and "patch_model" in res["unpatched"], res["unpatched"]


def test_ulysses_sp2_matches_one_process():
    _assert_results(run_distributed(_sp_worker, 2, args=(SP2_ARCHS,)), sp_size=2, archs=SP2_ARCHS)


def test_ulysses_sp4_replicated_kv_heads_matches_one_process():
    _assert_results(run_distributed(_sp_worker, 4, args=(ARCHS,)), sp_size=4, archs=ARCHS)


def test_lengths_put_shard_edges_inside_sequences():
    """Guards the test data: every SP shard edge splits a sequence, and the total needs padding."""
    starts = set(torch.tensor(LENGTHS).cumsum(0).tolist()) | {0}
    for sp in (2, 4):
        padded = -(-sum(LENGTHS) // sp) * sp
        assert sum(LENGTHS) % sp
        assert all(edge not in starts for edge in range(padded // sp, sum(LENGTHS), padded // sp))
