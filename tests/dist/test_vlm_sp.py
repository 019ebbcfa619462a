"""VLMs under Ulysses SP=2 (gloo): per-token log-probs and entropy equal one process's, and parameter gradients
averaged over the SP group (vision tower included) equal one process's.

Batches: the standard mix (images, two-image, video, text only); one whose image tokens all land on the
first shard and one whose image tokens all land on the last (the other rank's shard has no visual token, and
for Qwen3-VL no DeepStack row, yet it must run the vision tower and the same collectives); a text-only batch
(no rank runs the vision tower; nothing hangs). Everything is checked in one spawn per test to keep process
start-up, the dominant cost, low.
"""

from collections import Counter

import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

SP = 2
ARCHS = ("qwen2_5_vl", "qwen3_vl", "glm4v", "qwen3_vl_moe", "kimi_k25", "qwen3_5")


def _batches(model):
    from actorcore.testing.tiny_vlm import mixed_samples, synthetic_sample

    g = torch.Generator().manual_seed(21)
    images = synthetic_sample(model, images=[(4, 6), (2, 4)], text_lengths=(3, 2, 4), generator=g)
    long_text = synthetic_sample(model, text_lengths=(40,), generator=g)
    short_text = synthetic_sample(model, text_lengths=(7,), generator=g)
    return {
        "mixed": mixed_samples(model, seed=5),
        "images_on_first_shard": [images, long_text, short_text],
        "images_on_last_shard": [short_text, long_text, images],
        "text_only": [long_text, short_text],
    }


def _shards_with_visual_tokens(batch, sp_size):
    from actorcore.batch import pad_to_multiple, shard_bounds

    work = pad_to_multiple(batch, sp_size)
    types = torch.nn.functional.pad(batch.multimodal["mm_token_type_ids"], (0, work.num_padding))
    return [int((types[slice(*shard_bounds(work.num_tokens, r, sp_size))] != 0).sum()) for r in range(sp_size)]


def _check_arch(model_type, ctx):
    import torch.distributed as dist

    import actorcore as ac
    from actorcore.archs import get_spec
    from actorcore.testing.tiny_vlm import build_tiny_vlm
    from actorcore.hf.vlm.packing import pack_multimodal

    reference, actor = build_tiny_vlm(model_type, seed=3), build_tiny_vlm(model_type, seed=3)
    ac.patch_model(actor, parallel=ctx)
    vision = get_spec(model_type).vision
    tower = f"{vision.base_model}.{vision.tower}"
    result = {"num_layers": actor.config.text_config.num_hidden_layers, "tower": tower}
    tower_calls = []
    actor.get_submodule(tower).register_forward_hook(lambda *a: tower_calls.append(1))
    for name, samples in _batches(reference).items():
        batch = pack_multimodal(reference, [s.input_ids for s in samples], [s.multimodal for s in samples])
        result[f"{name}/visual_tokens_per_shard"] = _shards_with_visual_tokens(batch, ctx.sp_size)
        trace, before_tower = Counter(), len(tower_calls)
        w = 0.5 + torch.rand(2, batch.num_tokens, generator=torch.Generator().manual_seed(7))
        ref = ac.compute_logprobs(reference, batch, temperature=0.9)
        out = ac.compute_logprobs(actor, batch, temperature=0.9, parallel=ctx, trace=trace)
        # attention layers, or (hybrid models) linear-attention layers
        result[f"{name}/ulysses_calls"] = (trace["attention:actorcore_ulysses"]
                                           + trace["linear_attention:actorcore_ulysses"])
        result[f"{name}/tower_calls"] = len(tower_calls) - before_tower
        result[f"{name}/logprob"] = (out.log_probs - ref.log_probs).abs().tolist()
        result[f"{name}/entropy"] = (out.entropy - ref.entropy).abs().tolist()
        if name in ("mixed", "images_on_first_shard"):
            reference.zero_grad(set_to_none=True)
            actor.zero_grad(set_to_none=True)
            ((w[0] * ref.log_probs).sum() + (w[1] * ref.entropy).sum()).backward()
            ((w[0] * out.log_probs).sum() + (w[1] * out.entropy).sum()).backward()
            diffs = {}
            for (pname, p_ref), (_, p) in zip(reference.named_parameters(), actor.named_parameters()):
                if p_ref.grad is None:
                    diffs[pname] = None if p.grad is None else float("inf")
                    continue
                g = p.grad.clone()
                dist.all_reduce(g, group=ctx.sp_group)
                g /= ctx.sp_size
                diffs[pname] = ((g - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp(min=1e-30)).item()
            result[f"{name}/grads"] = diffs
    return result


def _worker(rank, world_size, archs):
    import torch.distributed as dist

    from actorcore.parallel import ParallelContext

    ctx = ParallelContext(sp_group=dist.new_group(list(range(world_size))))
    return {arch: _check_arch(arch, ctx) for arch in archs}


def test_vlm_sp2_matches_one_process():
    results = run_distributed(_worker, SP, args=(ARCHS,))
    tol, grad_tol = TOL["sp_vs_single_fp32"], TOL["grad_sp_vs_single_fp32_rel"]
    for rank, res in enumerate(results):
        for arch in ARCHS:
            r = res[arch]
            where = f"sp={SP} rank {rank} {arch}"
            shards = {name: r[f"{name}/visual_tokens_per_shard"] for name in
                      ("mixed", "images_on_first_shard", "images_on_last_shard", "text_only")}
            assert shards["images_on_first_shard"][0] > 0 and shards["images_on_first_shard"][1:] == [0] * (SP - 1)
            assert shards["images_on_last_shard"][-1] > 0 and shards["images_on_last_shard"][:-1] == [0] * (SP - 1)
            assert shards["text_only"] == [0] * SP and all(n > 0 for n in shards["mixed"])
            for name in shards:
                assert r[f"{name}/ulysses_calls"] == r["num_layers"], f"{where} {name}: Ulysses did not run"
                # every rank runs the tower once on the whole batch (images and videos together), text never
                want_tower = 0 if name == "text_only" else 1
                assert r[f"{name}/tower_calls"] == want_tower, f"{where} {name}: vision tower calls"
                for key in ("logprob", "entropy"):
                    worst = max(r[f"{name}/{key}"])
                    assert worst <= tol, f"{where} {name}: {key} max |Δ| {worst:.2e}"
            for name in ("mixed", "images_on_first_shard"):
                grads = r[f"{name}/grads"]
                assert any(k.startswith(r["tower"] + ".") and v is not None for k, v in grads.items())
                for pname, rel in grads.items():
                    assert rel is None or rel <= grad_tol, f"{where} {name}: grad {pname} relative diff {rel:.2e}"
