"""Ulysses SP with the FA4 attention backend (``patch_model(parallel=ctx, attention_backend="fa4")``), 2 gloo
processes: per-token log-probs and the SP-averaged parameter gradients equal one unpatched process's, and every
rank's attention ran FA4 in every layer, on its share of the heads (gpt-oss: its sinks split over the ranks, sliding
and full layers; gemma2: softcap and a window). flash-attn-4's entry points are the stand-in of
``actorcore.testing.fa4_stand_in`` (the kernels need a Hopper GPU)."""

from collections import Counter

from support.sequence_parallel import grad_rel_diffs, loss_weights, sp_sequences

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL


ARCHS = ("gpt_oss", "gemma2")


def _fa4_sp_worker(rank, world_size):
    import torch
    import torch.distributed as dist

    import actorcore as ac
    from actorcore.parallel import ParallelContext
    from actorcore.testing.fa4_stand_in import use_fa4_stand_in
    from actorcore.testing.tiny_configs import build_tiny_model

    ctx = ParallelContext(sp_group=dist.new_group(list(range(world_size))))
    stand_in, undo = use_fa4_stand_in()
    results = {}
    try:
        for model_type in ARCHS:
            reference, actor = build_tiny_model(model_type, seed=3), build_tiny_model(model_type, seed=3)
            if model_type == "gpt_oss":
                with torch.no_grad():
                    for a, b in zip(reference.model.layers, actor.model.layers):
                        a.self_attn.sinks.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(1))
                        b.self_attn.sinks.copy_(a.self_attn.sinks)
            batch = ac.pack(sp_sequences())
            w = loss_weights(batch.num_tokens)
            handle = ac.patch_model(actor, parallel=ctx, attention_backend="fa4")
            ref = ac.compute_logprobs(reference, batch)
            calls = len(stand_in.calls)
            trace = Counter()
            out = ac.compute_logprobs(actor, batch, parallel=ctx, trace=trace)
            (w[0] * ref.log_probs).sum().backward()
            (w[0] * out.log_probs).sum().backward()
            results[model_type] = {
                "logprob": (out.log_probs - ref.log_probs).abs().max().item(),
                "grads": grad_rel_diffs(reference, actor, ctx.sp_group, ctx.sp_size),
                "trace": dict(trace), "layers": actor.config.num_hidden_layers,
                "calls": Counter(kind for kind, _ in stand_in.calls[calls:]),
                "sinks": {call["sink"] for _, call in stand_in.calls[calls:]}}
            handle.revert()
    finally:
        undo()
    return results


def test_ulysses_sp2_on_fa4_matches_one_process():
    for rank, results in enumerate(run_distributed(_fa4_sp_worker, 2)):
        for model_type in ARCHS:
            r, where = results[model_type], f"rank {rank} {model_type}"
            layers = r["layers"]
            assert r["trace"]["attention:actorcore_ulysses"] == layers, where
            assert r["trace"]["varlen_attention:fa4"] == layers and "varlen_attention:segments" not in r["trace"]
            assert r["calls"] == {"forward": layers, "backward": layers}, (where, r["calls"])
            assert r["sinks"] == {model_type == "gpt_oss"}, where
            assert r["logprob"] <= TOL["sp_vs_single_fp32"], (where, r["logprob"])
            for name, rel in r["grads"].items():
                assert rel <= TOL["grad_sp_vs_single_fp32_rel"], (where, name, rel)
