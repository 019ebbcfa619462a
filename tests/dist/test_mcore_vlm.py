"""Qwen2.5-VL on the Megatron route (gloo, CPU): the HF checkpoint loads and exports back bit-exact (vision tower
included) at TP=1 and TP=2; a packed batch of sequences with images, a video and text only gives per-token
log-probs and entropy equal to the HF model's own fp32 forward one sequence at a time (the independent
reference) and to actorcore's HF route; gradients of tower and language-model parameters equal the HF
forward's, at TP=1 and TP=2 (the replicated tower gets the full gradient on every TP rank). A checkpoint that
stores the in-memory names (``model.language_model.*``, ``model.visual.*``) loads the same weights."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

pytest.importorskip("megatron.core")

MODEL_TYPE = "qwen2_5_vl"
# Megatron parameter -> the HF model's in-memory parameter whose gradient it must equal (whole tensors: no TP
# split, or compared on the rows this rank holds).
GRAD_PAIRS = {
    "vision_tower.patch_embed.proj.weight": "model.visual.patch_embed.proj.weight",
    "vision_tower.blocks.0.attn.qkv.weight": "model.visual.blocks.0.attn.qkv.weight",
    "vision_tower.merger.mlp.2.bias": "model.visual.merger.mlp.2.bias",
    "decoder.layers.0.input_layernorm.weight": "model.language_model.layers.0.input_layernorm.weight",
    "decoder.final_layernorm.weight": "model.language_model.norm.weight",
}


def _tiny_vlm():
    from test_mcore_roundtrip import randomize_constant_tensors

    from actorcore.testing.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(MODEL_TYPE, seed=4)
    randomize_constant_tensors(model, seed=2)
    # Sharper attention and logits than the 0.02-std init: positions (M-RoPE) and image features then move the
    # log-probs far beyond the tolerance, so a wrong rotary section or a dropped feature cannot pass.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "lm_head.weight")):
                param.mul_(6.0)
    return model


def _samples(model):
    from actorcore.testing.tiny_vlm import mixed_samples

    return mixed_samples(model, seed=3)  # one image, text only, two images, a video, short text only


def _worker(rank: int, world_size: int, directory: str) -> dict:
    """TP=1 (the two ranks as data-parallel replicas), then TP=2, in one world."""
    from megatron.core import parallel_state

    from actorcore.mcore.cpu_runtime import CpuRuntime

    results = {}
    with CpuRuntime():
        for tp in (1, 2):
            results[tp] = _worker_body(tp, directory)
            parallel_state.destroy_model_parallel()
    return results


def _worker_body(tp: int, directory: str) -> dict:
    import actorcore as ac
    from actorcore.mcore.forward import compute_logprobs
    from actorcore.mcore.load import load_hf_into_mcore
    from actorcore.mcore.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.safetensors_reader import SafetensorsReader
    from actorcore.mcore.weight_stream import gather_hf_state_dict
    from actorcore.testing.reference_vlm import reference_logprobs_vlm

    hf = _tiny_vlm()
    parallel = McoreParallel(tp=tp)
    initialize_megatron(parallel)
    model = build_gpt_model(hf.config, parallel)
    assert model.vlm_config is hf.config and model.hf_config.model_type == hf.config.model_type
    chunks = model.chunks
    load_hf_into_mcore(model, directory)

    exported = gather_hf_state_dict(model)
    reader = SafetensorsReader(directory)
    assert set(exported) == reader.names()
    roundtrip_exact = all(torch.equal(exported[n], reader.read(n)) and exported[n].dtype == reader.dtype(n)
                          for n in reader.names())
    # The same weights stored under the in-memory names (transformers 4.52-4.57's save_pretrained) load the same.
    again = build_gpt_model(hf.config, parallel)
    with torch.no_grad():
        for param in again.chunks[0].parameters():
            param.zero_()
    load_hf_into_mcore(again, os.path.join(directory, "in_memory_names"))
    ours = again.chunks[0].state_dict()
    roundtrip_exact &= all(torch.equal(t, ours[k]) for k, t in chunks[0].state_dict().items()
                           if isinstance(t, torch.Tensor) and not k.endswith("_extra_state"))

    samples = _samples(hf)
    batch = ac.pack([s.input_ids for s in samples], multimodal=[s.multimodal for s in samples], model=hf)
    assert batch.position_ids.shape == (3, batch.num_tokens)
    calls = []
    hook = chunks[0].vision_tower.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    got = compute_logprobs(model, batch)
    hook.remove()
    # One tower call for all the batch's images and one for its video, on every TP rank.
    tower_calls_ok = calls == [int(batch.multimodal["pixel_values"].shape[0]),
                               int(batch.multimodal["pixel_values_videos"].shape[0])]
    with torch.no_grad():
        hf_route = ac.compute_logprobs(hf, batch)

    weights = 0.5 + torch.rand(batch.num_tokens, generator=torch.Generator().manual_seed(5))

    def loss_fn(out, _batch):
        return -(out.log_probs * weights).sum() + out.entropy.sum()

    fb = compute_logprobs(model, batch, loss_fn=loss_fn)
    hf.zero_grad()
    lps, ents = zip(*(reference_logprobs_vlm(hf, [s]) for s in samples))  # one sequence at a time
    ref_lp, ref_ent = torch.cat(lps), torch.cat(ents)
    (-(ref_lp * weights).sum() + ref_ent.sum()).backward()
    ref_lp, ref_ent = ref_lp.detach(), ref_ent.detach()
    params = dict(chunks[0].named_parameters())
    hf_params = dict(hf.named_parameters())
    grads = {name: (params[name].grad.clone(), hf_params[hf_name].grad.clone()) for name, hf_name in GRAD_PAIRS.items()}
    return {"roundtrip_exact": roundtrip_exact, "tower_calls_ok": tower_calls_ok, "lp": got.log_probs, "ent": got.entropy, "fb": fb.log_probs,
            "hf_route": (hf_route.log_probs, hf_route.entropy), "ref": (ref_lp, ref_ent), "grads": grads,
            "starts": batch.cu_seqlens[:-1].long()}


def test_qwen2_5_vl_megatron_matches_hf_tp1_tp2():
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as directory:
        model = _tiny_vlm()
        model.save_pretrained(directory)
        os.makedirs(os.path.join(directory, "in_memory_names"))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(directory, "in_memory_names", "model.safetensors"), metadata={"format": "pt"})
        results = run_distributed(_worker, 2, args=(directory,))
    tol, grad_tol = TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"]
    cases = [(rank, tp, per_tp[tp]) for rank, per_tp in enumerate(results) for tp in (1, 2)]
    for rank, tp, r in cases:
        assert r["roundtrip_exact"], f"rank {rank} tp={tp}: HF -> Megatron -> HF is not bit-exact"
        assert r["tower_calls_ok"], f"rank {rank} tp={tp}: the vision tower did not run once per modality"
        ref_lp, ref_ent = r["ref"]
        assert r["lp"].dtype == torch.float32 and r["lp"].shape == ref_lp.shape
        assert torch.all(r["lp"][r["starts"]] == 0) and bool((r["lp"] != 0).any())
        for got, want in ((r["lp"], ref_lp), (r["ent"], ref_ent), (r["fb"], ref_lp), (r["lp"], r["hf_route"][0]),
                          (r["ent"], r["hf_route"][1])):
            torch.testing.assert_close(got, want, atol=tol, rtol=0)
        for name, (grad, ref) in r["grads"].items():
            assert bool((ref != 0).any()), name
            torch.testing.assert_close(grad, ref, atol=grad_tol * ref.abs().max(), rtol=0,
                                       msg=f"rank {rank} tp={tp} {name}")


def test_vision_tower_class_without_an_auto_mapping(monkeypatch):
    """transformers 5.17 (the GPU machine's) maps no AutoModel to Qwen2.5-VL's vision config, 5.24 does: the tower
    class is then the family's pretrained class whose ``config_class`` the vision config is."""
    import transformers.models.auto.modeling_auto as modeling_auto
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from actorcore.mcore.vlm import vision_tower_class

    assert vision_tower_class(Qwen2_5_VLVisionConfig()) is Qwen2_5_VisionTransformerPretrainedModel
    monkeypatch.setattr(modeling_auto, "MODEL_MAPPING", {})
    assert vision_tower_class(Qwen2_5_VLVisionConfig()) is Qwen2_5_VisionTransformerPretrainedModel
