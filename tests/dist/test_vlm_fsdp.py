"""FSDP2 (gloo, 2 data-parallel processes) with a sharded vision tower: one rank's batch has images and a
video, the other's is text only. The text-only rank must still run the tower (its forward all-gathers the
sharded parameters), or the ranks would hang; the reduced gradients equal one process's on both batches."""

import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

MODEL_TYPE = "qwen3_vl"  # DeepStack: the deepstack mergers are sharded too


def _batches(model):
    from actorcore.testing.tiny_vlm import mixed_samples, synthetic_sample

    g = torch.Generator().manual_seed(9)
    return [mixed_samples(model, seed=4), [synthetic_sample(model, text_lengths=(n,), generator=g) for n in (12, 5)]]


def _loss(model, samples):
    import actorcore as ac
    from actorcore.hf.vlm.packing import pack_multimodal

    batch = pack_multimodal(model, [s.input_ids for s in samples], [s.multimodal for s in samples])
    out = ac.compute_logprobs(model, batch, temperature=0.9)
    return out.log_probs.sum() + 0.5 * out.entropy.sum()


def _fsdp_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from actorcore.testing.tiny_vlm import build_tiny_vlm

    # An explicit CPU mesh: on a machine with CUDA, FSDP2 would otherwise pick the GPU as its device.
    mesh = init_device_mesh("cpu", (world_size,))
    model = build_tiny_vlm(MODEL_TYPE, seed=6)
    tower_calls = []
    model.model.visual.register_forward_hook(lambda *a: tower_calls.append(1))
    for module in [*model.model.visual.blocks, model.model.visual, *model.model.language_model.layers, model]:
        fully_shard(module, mesh=mesh)
    _loss(model, _batches(model)[rank]).backward()  # FSDP averages gradients over ranks
    return {"tower_calls": len(tower_calls),
            "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}}


def test_fsdp2_text_only_rank_does_not_hang_and_gradients_match():
    from actorcore.testing.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(MODEL_TYPE, seed=6)
    (sum(_loss(model, samples) for samples in _batches(model)) / 2).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    results = run_distributed(_fsdp_worker, 2)
    assert [r["tower_calls"] for r in results] == [1, 1]  # images and videos together; one dummy image
    got = results[0]["grads"]
    assert got.keys() == want.keys() and any(n.startswith("model.visual.") for n in want)
    for name, grad in want.items():
        rel = ((got[name] - grad).abs().max() / grad.abs().max().clamp(min=1e-30)).item()
        assert rel <= TOL["grad_sp_vs_single_fp32_rel"], f"{name}: relative grad difference {rel:.2e}"
