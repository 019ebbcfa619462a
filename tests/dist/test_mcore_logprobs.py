"""Megatron per-token log-probs / entropy == HF route per token (fp32), at TP=2, PP=2 and EP=2 (gloo, CPU)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

pytest.importorskip("megatron.core")

LENGTHS = [(5, 11, 3, 9), (14, 2, 7), (1, 6, 12)]


def _batches(pad_to: int | None = None):
    import actorcore as ac
    from actorcore.batch import pad_to_multiple

    gen = torch.Generator().manual_seed(7)
    batches = [ac.pack([torch.randint(3, 131, (n,), generator=gen) for n in lengths]) for lengths in LENGTHS]
    if pad_to:
        batches = [pad_to_multiple(b, pad_to) if b.num_tokens % pad_to else b for b in batches]
    return batches


def _worker(rank: int, world_size: int, model_type: str, tp: int, pp: int, ep: int, directory: str) -> dict:
    from actorcore.hf.logprobs import compute_logprobs as hf_compute_logprobs
    from actorcore.mcore.checkpoint import load_hf_into_mcore
    from actorcore.mcore.forward import compute_logprobs
    from actorcore.mcore.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.testing import mcore_shims
    from actorcore.testing.tiny_configs import build_tiny_model

    mcore_shims.apply()
    hf = build_tiny_model(model_type, seed=5)
    parallel = McoreParallel(tp=tp, pp=pp, ep=ep)
    groups = initialize_megatron(parallel)
    chunks = build_gpt_model(hf.config, parallel)
    load_hf_into_mcore(chunks, directory, groups)
    # PP needs equal micro-batch token counts: pad every batch to 32 tokens (a padding segment).
    batches = _batches(pad_to=32 if pp > 1 else None)

    got = compute_logprobs(chunks, batches, groups)
    with torch.no_grad():
        ref = [hf_compute_logprobs(hf, b) for b in batches]

    # Forward-backward through the schedule: gradient of the final norm and the first layer's input norm.
    def loss_fn(out, batch):
        return -out.log_probs.sum()

    fb = compute_logprobs(chunks, batches, groups, loss_fn=loss_fn)
    hf.zero_grad()
    for b in batches:
        (hf_compute_logprobs(hf, b).log_probs.sum() * (-1.0 / len(batches))).backward()
    grads = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name == "decoder.final_layernorm.weight":
                grads["model.norm.weight"] = (param.grad.clone(), hf.model.norm.weight.grad.clone())
            if name == "decoder.layers.0.input_layernorm.weight" and chunk.decoder.layers[0].layer_number == 1:
                grads["model.layers.0.input_layernorm.weight"] = (
                    param.grad.clone(), hf.model.layers[0].input_layernorm.weight.grad.clone())
    return {"got": [(o.log_probs, o.entropy) for o in got], "fb": [o.log_probs for o in fb],
            "ref": [(o.log_probs, o.entropy) for o in ref], "grads": grads}


def _run(model_type: str, tp: int, pp: int, ep: int) -> None:
    from actorcore.testing.tiny_configs import build_tiny_model

    with tempfile.TemporaryDirectory() as directory:
        build_tiny_model(model_type, seed=5).save_pretrained(directory)
        results = run_distributed(_worker, tp * pp * ep, args=(model_type, tp, pp, ep, directory))
    tol = TOL["mcore_vs_hf_fp32"]
    seen_grads = set()
    for rank, result in enumerate(results):
        for (lp, ent), (ref_lp, ref_ent), fb in zip(result["got"], result["ref"], result["fb"]):
            assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0)
            torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0)
            assert bool((lp != 0).any())
        for name, (grad, ref_grad) in result["grads"].items():
            seen_grads.add(name)
            scale = ref_grad.abs().max()
            torch.testing.assert_close(grad, ref_grad, atol=1e-4 * scale, rtol=0, msg=f"rank {rank} {name}")
    assert seen_grads == {"model.norm.weight", "model.layers.0.input_layernorm.weight"}


@pytest.mark.slow
def test_logprobs_dense_tp2():
    _run("qwen2", tp=2, pp=1, ep=1)


@pytest.mark.slow
def test_logprobs_dense_pp2():
    _run("llama", tp=1, pp=2, ep=1)


@pytest.mark.slow
def test_logprobs_moe_ep2():
    _run("qwen3_moe", tp=1, pp=1, ep=2)
