"""Vision-language models on the Megatron route (gloo, CPU): Qwen2.5-VL, Qwen3-VL (interleaved M-RoPE, deepstack),
Qwen3-VL-MoE and Kimi-K2.5 (1-D positions, MoonViT + projector, the tower's attention fused as its checkpoints
store it: that parameter's gradient equals HF's q / k / v gradients in the fused layout). For each family and
layout the HF checkpoint loads and exports back bit-exact (vision tower included); a packed batch of sequences
with images, a video and text only gives per-token log-probs and entropy equal to the HF model's own fp32 forward
one sequence at a time (the independent reference); gradients of tower (deepstack mergers included) and
language-model parameters equal the HF forward's.

Layouts: Qwen2.5-VL at TP=1 and TP=2; Qwen3-VL at TP=2 and PP=2 (both deepstack layers on the first stage);
Qwen3-VL-MoE at EP=2, PP=2 and TP=2 (with sequence parallelism, which Megatron needs to train MoE under TP: the
decoder input and the deepstack additions are split over the TP ranks); Kimi-K2.5 at TP=2 (sequence
parallelism), PP=2 and EP=2. Every case runs in one two-rank spawn (``world2``). A Qwen2.5-VL checkpoint that
stores the in-memory names (``model.language_model.*``, ``model.visual.*``) loads the same weights. Kimi-K2.5's
checkpoint has the release's names (``support/kimi_release``), which the export writes back; the same weights under
transformers' save_pretrained names load the same."""

from __future__ import annotations

import os

import pytest
import torch

from support.mcore_cases import spawn_cases
from actorcore.testing.tolerances import TOL
from support.mcore_vlm import vlm_samples, tiny_vlm


pytest.importorskip("megatron.core")

_VISUAL = "model.visual."
_TEXT = "model.language_model."
# Megatron parameter (global name) -> the HF model's in-memory parameter whose gradient it must equal (whole
# tensors: replicated over TP, or summed over the TP ranks under sequence parallelism).
GRAD_PAIRS = {
    "qwen2_5_vl": {
        "vision_tower.patch_embed.proj.weight": _VISUAL + "patch_embed.proj.weight",
        "vision_tower.blocks.0.attn.qkv.weight": _VISUAL + "blocks.0.attn.qkv.weight",
        "vision_tower.merger.mlp.2.bias": _VISUAL + "merger.mlp.2.bias",
        "decoder.layers.0.input_layernorm.weight": _TEXT + "layers.0.input_layernorm.weight",
        "decoder.final_layernorm.weight": _TEXT + "norm.weight",
    },
    "qwen3_vl": {
        "vision_tower.patch_embed.proj.weight": _VISUAL + "patch_embed.proj.weight",
        "vision_tower.pos_embed.weight": _VISUAL + "pos_embed.weight",
        "vision_tower.blocks.1.attn.qkv.weight": _VISUAL + "blocks.1.attn.qkv.weight",
        "vision_tower.merger.linear_fc2.bias": _VISUAL + "merger.linear_fc2.bias",
        # the deepstack mergers reach the loss only through the deepstack additions to decoder layers 0 and 1
        "vision_tower.deepstack_merger_list.0.linear_fc1.weight": _VISUAL + "deepstack_merger_list.0.linear_fc1.weight",
        "vision_tower.deepstack_merger_list.1.linear_fc2.bias": _VISUAL + "deepstack_merger_list.1.linear_fc2.bias",
        "decoder.layers.0.input_layernorm.weight": _TEXT + "layers.0.input_layernorm.weight",
        "decoder.layers.3.pre_mlp_layernorm.weight": _TEXT + "layers.3.post_attention_layernorm.weight",
        "decoder.final_layernorm.weight": _TEXT + "norm.weight",
    },
    "qwen3_vl_moe": {
        "vision_tower.patch_embed.proj.weight": _VISUAL + "patch_embed.proj.weight",
        "vision_tower.blocks.0.mlp.linear_fc1.weight": _VISUAL + "blocks.0.mlp.linear_fc1.weight",
        "vision_tower.deepstack_merger_list.0.linear_fc2.weight": _VISUAL + "deepstack_merger_list.0.linear_fc2.weight",
        "decoder.layers.0.mlp.router.weight": _TEXT + "layers.0.mlp.gate.weight",
        "decoder.layers.1.input_layernorm.weight": _TEXT + "layers.1.input_layernorm.weight",
        "decoder.final_layernorm.weight": _TEXT + "norm.weight",
    },
    "kimi_k25": {
        "vision_tower.vision_tower.patch_embed.proj.weight": "model.vision_tower.patch_embed.proj.weight",
        "vision_tower.vision_tower.patch_embed.pos_emb.position_embeddings":
            "model.vision_tower.patch_embed.pos_emb.position_embeddings",
        "vision_tower.vision_tower.layers.0.attn.proj.weight": "model.vision_tower.layers.0.attn.proj.weight",
        "vision_tower.vision_tower.layers.1.mlp.fc1.weight": "model.vision_tower.layers.1.mlp.fc1.weight",
        "vision_tower.mm_projector.pre_norm.weight": "model.mm_projector.pre_norm.weight",
        "vision_tower.mm_projector.out_proj.bias": "model.mm_projector.out_proj.bias",
        "decoder.layers.0.input_layernorm.weight": _TEXT + "layers.0.input_layernorm.weight",
        "decoder.layers.1.mlp.router.weight": _TEXT + "layers.1.mlp.gate.weight",
        "decoder.final_layernorm.weight": _TEXT + "norm.weight",
    },
}
# Kimi-K2.5's tower attention is one fused parameter (the checkpoint's wqkv: q and k rows interleaved per head):
# its gradient is HF's q / k / v gradients in that layout (the HF module prefix of each fused parameter).
FUSED_QKV_GRADS = {"kimi_k25": {"vision_tower.vision_tower.layers.0.attn.wqkv.weight": "model.vision_tower.layers.0.attn.",
                                "vision_tower.vision_tower.layers.1.attn.wqkv.bias": "model.vision_tower.layers.1.attn."}}
# (model_type, tp, pp, ep) of every case.
CASES = [("qwen2_5_vl", 1, 1, 1), ("qwen2_5_vl", 2, 1, 1), ("qwen3_vl", 2, 1, 1), ("qwen3_vl", 1, 2, 1),
         ("qwen3_vl_moe", 1, 1, 2), ("qwen3_vl_moe", 1, 2, 1), ("qwen3_vl_moe", 2, 1, 1),
         ("kimi_k25", 2, 1, 1), ("kimi_k25", 1, 2, 1), ("kimi_k25", 1, 1, 2)]


def _interleaved_qkv(attn_params: dict, prefix: str, kind: str, heads: int, grad: bool) -> torch.Tensor:
    """The checkpoint's fused ``wqkv`` layout of HF's q / k / v (or of their gradients): each head's two rotary
    halves of q and k zipped row by row, then v (plain torch, independent of the product's permutation)."""
    def interleave(t):
        return t.reshape(heads, 2, t.shape[0] // heads // 2, -1).transpose(1, 2).reshape(t.shape)

    q, k, v = (attn_params[f"{prefix}{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj"))
    q, k, v = (t.grad if grad else t for t in (q, k, v))
    return torch.cat([interleave(q), interleave(k), v])


def _case(model_type: str, tp: int, pp: int, ep: int, directory: str) -> dict:
    import actorcore as ac
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import checkpoint_expert_layout, load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.safetensors_reader import SafetensorsReader
    from actorcore.mcore.convert.weight_layout import global_mcore_name
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict
    from actorcore.testing.reference_vlm import reference_logprobs_vlm
    hf = tiny_vlm(model_type)
    parallel = McoreParallel(tp=tp, pp=pp, ep=ep)
    initialize_megatron(parallel)
    layout = checkpoint_expert_layout(directory, hf.config)
    model = build_gpt_model(hf.config, parallel, expert_layout=layout)
    assert model.vlm_config is hf.config and model.hf_config.model_type == hf.config.model_type
    chunks = model.chunks
    load_hf_into_mcore(model, directory)

    exported = gather_hf_state_dict(model)
    reader = SafetensorsReader(directory)
    roundtrip_exact = set(exported) == reader.names() and all(
        torch.equal(exported[n], reader.read(n)) and exported[n].dtype == reader.dtype(n) for n in reader.names())
    stored = os.path.join(directory, "other_names")
    if os.path.exists(stored):  # the same weights under other names load the same
        again = build_gpt_model(hf.config, parallel)
        with torch.no_grad():
            for param in again.chunks[0].parameters():
                param.zero_()
        load_hf_into_mcore(again, stored)
        ours = again.chunks[0].state_dict()
        roundtrip_exact &= all(torch.equal(t, ours[k]) for k, t in chunks[0].state_dict().items()
                               if isinstance(t, torch.Tensor) and not k.endswith("_extra_state"))

    samples = vlm_samples(hf)
    batch = ac.pack([s.input_ids for s in samples], multimodal=[s.multimodal for s in samples], model=hf)
    one_d = model_type == "kimi_k25"  # plain 1-D positions; the others M-RoPE
    assert batch.position_ids.shape == ((batch.num_tokens,) if one_d else (3, batch.num_tokens))
    calls = []
    hooks = [chunk.vision_tower.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
             for chunk in chunks if chunk.pre_process]
    got = compute_logprobs(model, batch)
    for hook in hooks:
        hook.remove()
    # One tower call for all the batch's images and one for its video, on every TP rank of the first stage.
    expected_calls = [int(batch.multimodal["pixel_values"].shape[0]), int(batch.multimodal["pixel_values_videos"].shape[0])]
    tower_calls_ok = calls == (expected_calls if hooks else [])

    weights = 0.5 + torch.rand(batch.num_tokens, generator=torch.Generator().manual_seed(5))

    def loss_fn(out, _batch):
        return -(out.log_probs * weights).sum() + out.entropy.sum()

    fb = compute_logprobs(model, batch, loss_fn=loss_fn)
    hf.zero_grad()
    lps, ents = zip(*(reference_logprobs_vlm(hf, [s]) for s in samples))  # one sequence at a time
    ref_lp, ref_ent = torch.cat(lps), torch.cat(ents)
    (-(ref_lp * weights).sum() + ref_ent.sum()).backward()
    hf_params = dict(hf.named_parameters())
    grads = {}
    for chunk in chunks:
        for local, param in chunk.named_parameters():
            name = global_mcore_name(chunk, local, model.context)
            if name in GRAD_PAIRS[model_type]:
                grads[name] = (param.grad.clone(), hf_params[GRAD_PAIRS[model_type][name]].grad.clone())
            prefix = FUSED_QKV_GRADS.get(model_type, {}).get(name)
            if prefix is not None:
                heads, kind = hf.config.vision_config.num_attention_heads, name.rsplit(".", 1)[1]
                grads[name] = (param.grad.clone(), _interleaved_qkv(hf_params, prefix, kind, heads, grad=True))
    return {"roundtrip_exact": roundtrip_exact, "tower_calls_ok": tower_calls_ok, "lp": got.log_probs,
            "ent": got.entropy, "fb": fb.log_probs, "ref": (ref_lp.detach(), ref_ent.detach()), "grads": grads,
            "sequence_parallel": bool(model.config.sequence_parallel), "starts": batch.cu_seqlens[:-1].long()}


def _name(model_type: str, tp: int, pp: int, ep: int) -> str:
    return f"{model_type}-tp{tp}-pp{pp}-ep{ep}"


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Every case of this file in one two-rank spawn."""
    from safetensors.torch import save_file

    from support.kimi_release import save_release_checkpoint

    root = str(tmp_path_factory.mktemp("mcore_vlm"))
    for model_type in {m for m, *_ in CASES}:
        model = tiny_vlm(model_type)
        directory = os.path.join(root, model_type)
        if model_type == "kimi_k25":  # the release's names; transformers' save_pretrained writes three otherwise
            save_release_checkpoint(model, directory)
            model.save_pretrained(os.path.join(directory, "other_names"))
            continue
        model.save_pretrained(directory)
        if model_type == "qwen2_5_vl":  # transformers 4.52-4.57's save_pretrained wrote the in-memory names
            os.makedirs(os.path.join(directory, "other_names"))
            save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                      os.path.join(directory, "other_names", "model.safetensors"), metadata={"format": "pt"})
    return spawn_cases(2, [(_name(*case), _case, (*case, os.path.join(root, case[0]))) for case in CASES])


@pytest.mark.parametrize("case", CASES, ids=[_name(*c) for c in CASES])
def test_vlm_megatron_matches_hf(world2, case):
    tol, grad_tol = TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"]
    results = world2[_name(*case)]
    seen = set()
    for rank, r in enumerate(results):
        assert r["roundtrip_exact"], f"rank {rank}: HF -> Megatron -> HF is not bit-exact"
        assert r["tower_calls_ok"], f"rank {rank}: the vision tower did not run once per modality"
        ref_lp, ref_ent = r["ref"]
        assert r["lp"].dtype == torch.float32 and r["lp"].shape == ref_lp.shape
        assert torch.all(r["lp"][r["starts"]] == 0) and bool((r["lp"] != 0).any())
        for got, want in ((r["lp"], ref_lp), (r["ent"], ref_ent), (r["fb"], ref_lp)):
            torch.testing.assert_close(got, want, atol=tol, rtol=0)
        for name, (grad, ref) in r["grads"].items():
            seen.add(name)
            if r["sequence_parallel"] and not name.startswith("vision_tower."):
                # each TP rank holds its tokens' share of a norm's gradient (Megatron all-reduces them later)
                grad = sum(other["grads"][name][0] for other in results)
            assert bool((ref != 0).any()), name
            torch.testing.assert_close(grad, ref, atol=grad_tol * ref.abs().max(), rtol=0, msg=f"rank {rank} {name}")
    expected = set(GRAD_PAIRS[case[0]]) | set(FUSED_QKV_GRADS.get(case[0], {}))
    assert seen == expected, expected - seen


def test_deepstack_layers_on_a_later_stage_are_refused():
    """Deepstack decoder layers must all be on the first pipeline stage (the one with the vision tower)."""
    from types import SimpleNamespace

    from actorcore.mcore.build.vlm import add_deepstack

    chunk = SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(layer_number=1)]))
    with pytest.raises(ValueError, match="first pipeline stage"):
        add_deepstack(chunk, 2, "qwen3_vl")


def test_vision_tower_class_without_an_auto_mapping(monkeypatch):
    """transformers 5.17 (the GPU machine's) maps no AutoModel to Qwen2.5-VL's vision config, 5.24 does: the tower
    class is then the family's pretrained class whose ``config_class`` the vision config is."""
    import transformers.models.auto.modeling_auto as modeling_auto
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from actorcore.mcore.build.vlm import vision_tower_class

    assert vision_tower_class(Qwen2_5_VLVisionConfig()) is Qwen2_5_VisionTransformerPretrainedModel
    monkeypatch.setattr(modeling_auto, "MODEL_MAPPING", {})
    assert vision_tower_class(Qwen2_5_VLVisionConfig()) is Qwen2_5_VisionTransformerPretrainedModel
