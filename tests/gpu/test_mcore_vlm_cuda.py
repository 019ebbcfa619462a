"""Qwen2.5-VL and Qwen3-VL (interleaved M-RoPE, deepstack) on the Megatron route on GPUs with NCCL (2 GPUs): at TP=2 and PP=2 the HF checkpoint loads and
exports back bit-exact (vision tower included), a packed batch with images, a video and text-only sequences
gives per-token log-probs and entropy equal to plain transformers' fp32 forward one sequence at a time (on the
CPU), and the gradients of tower and language-model parameters equal its gradients. Skipped without two CUDA
devices or megatron-core."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from actorcore.testing.tolerances import TOL

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

# Megatron parameter -> the HF parameter whose gradient it must equal; ``{layer}``: the global index of the stage's
# first decoder layer (under PP=2 the second stage's local layer 0 is the model's layer 1).
GRAD_PAIRS = {
    "qwen2_5_vl": {
        "vision_tower.patch_embed.proj.weight": "model.visual.patch_embed.proj.weight",
        "vision_tower.blocks.0.attn.qkv.weight": "model.visual.blocks.0.attn.qkv.weight",
        "vision_tower.merger.mlp.2.bias": "model.visual.merger.mlp.2.bias",
        "decoder.layers.0.input_layernorm.weight": "model.language_model.layers.{layer}.input_layernorm.weight",
    },
    "qwen3_vl": {
        "vision_tower.patch_embed.proj.weight": "model.visual.patch_embed.proj.weight",
        "vision_tower.blocks.0.attn.qkv.weight": "model.visual.blocks.0.attn.qkv.weight",
        "vision_tower.deepstack_merger_list.1.linear_fc1.weight": "model.visual.deepstack_merger_list.1.linear_fc1.weight",
        "decoder.layers.0.input_layernorm.weight": "model.language_model.layers.{layer}.input_layernorm.weight",
    },
}


# The tiny model and its samples are the gloo test's (spawned ranks inherit this path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "dist"))
from support.mcore_vlm import vlm_samples, tiny_vlm  # noqa: E402


def _worker(rank: int, world_size: int, model_type: str, tp: int, pp: int, hf_dir: str) -> dict:
    import actorcore as ac
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict
    from megatron.core import parallel_state

    hf = tiny_vlm(model_type)  # on the CPU: only its rope-index function is used, to pack
    parallel = McoreParallel(tp=tp, pp=pp)
    initialize_megatron(parallel)
    mcore_model = build_gpt_model(hf.config, parallel)
    chunks = mcore_model.chunks
    assert next(chunks[0].parameters()).is_cuda
    load_hf_into_mcore(mcore_model, hf_dir)
    exported = {k: v.cpu() for k, v in gather_hf_state_dict(mcore_model).items()}
    samples = vlm_samples(hf)
    batch = ac.pack([s.input_ids for s in samples], multimodal=[s.multimodal for s in samples], model=hf)
    weights = 0.5 + torch.rand(batch.num_tokens, generator=torch.Generator().manual_seed(5))

    def loss_fn(out, _batch):
        return -(out.log_probs * weights.to(out.log_probs.device)).sum() + out.entropy.sum()

    out = compute_logprobs(mcore_model, batch, loss_fn=loss_fn)
    params = dict(chunks[0].named_parameters())
    layer = chunks[0].decoder.layers[0].layer_number - 1  # Megatron numbers layers globally, from 1
    grads = {hf_name.format(layer=layer): params[name].grad.cpu() for name, hf_name in GRAD_PAIRS[model_type].items()
             if name in params and params[name].grad is not None}
    parallel_state.destroy_model_parallel()
    return {"exported": exported, "lp": out.log_probs.cpu(), "ent": out.entropy.cpu(),
            "device": out.log_probs.device.type, "grads": grads, "weights": weights, "layer": layer}


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_vlm_megatron_on_nccl(tmp_path, model_type, tp, pp):
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file
    from support.mcore_nccl import run_nccl

    from actorcore.testing.reference_vlm import reference_logprobs_vlm

    hf = tiny_vlm(model_type)
    hf_dir = str(tmp_path / "hf")
    hf.save_pretrained(hf_dir)
    results = run_nccl(_worker, tp * pp, (model_type, tp, pp, hf_dir))
    source = load_file(os.path.join(hf_dir, "model.safetensors"))
    samples = vlm_samples(hf)
    lps, ents = zip(*(reference_logprobs_vlm(hf, [s]) for s in samples))
    ref_lp, ref_ent = torch.cat(lps), torch.cat(ents)
    (-(ref_lp * results[0]["weights"]).sum() + ref_ent.sum()).backward()
    hf_params = dict(hf.named_parameters())
    tol, grad_tol = TOL["mcore_cuda_vs_hf_fp32"], TOL["grad_mcore_cuda_vs_hf_fp32_rel"]
    seen = set()
    for rank, r in enumerate(results):
        assert sorted(r["exported"]) == sorted(source), rank
        for name, tensor in source.items():
            assert r["exported"][name].dtype == tensor.dtype and torch.equal(r["exported"][name], tensor), (rank, name)
        assert r["device"] == "cuda"
        torch.testing.assert_close(r["lp"], ref_lp.detach(), atol=tol, rtol=0, msg=f"rank {rank} log-probs")
        torch.testing.assert_close(r["ent"], ref_ent.detach(), atol=tol, rtol=0, msg=f"rank {rank} entropy")
        for hf_name, grad in r["grads"].items():
            seen.add(hf_name)
            ref = hf_params[hf_name].grad
            torch.testing.assert_close(grad, ref, atol=grad_tol * ref.abs().max(), rtol=0,
                                       msg=f"rank {rank} {hf_name}")
    layers = sorted({r["layer"] for r in results})
    assert layers[0] == 0 and len(layers) == pp
    assert seen == {hf_name.format(layer=layer) for hf_name in GRAD_PAIRS[model_type].values() for layer in layers}
