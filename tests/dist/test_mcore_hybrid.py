"""Hybrid Gated DeltaNet / gated-attention models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on the Megatron route (gloo,
CPU): per-token log-probs, entropy and gradients against the model's own transformers forward in fp32 (its torch
fallback of the conv and the delta rule) at TP=2, PP=2 and EP=2; conversion both ways bit-exact; and leak tests: a
packed batch's per-token outputs equal each sequence run alone, with the conv and then the delta rule as the only
path that could carry anything from one sequence into the next.

Every case of the file runs in one two-rank spawn (a module-scoped fixture); each test asserts its own case."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from support.mcore_cases import spawn_cases
from actorcore.archs import get_spec
from actorcore.testing.tolerances import TOL
from support.mcore_hybrid import LENGTHS, hybrid_reference, hybrid_sequences, tiny_hf


pytest.importorskip("megatron.core")

GDN = "decoder.layers.0.self_attention."  # layer 0 is a linear-attention layer in every tiny config


def _batches(pad_to: int | None):
    import actorcore as ac
    from actorcore.batch import pad_to_multiple

    batches = [ac.pack(s) for s in hybrid_sequences()]
    return [pad_to_multiple(b, pad_to) if pad_to and b.num_tokens % pad_to else b for b in batches]


def _local_grad(name: str, full: torch.Tensor, hf_config, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of an HF gradient, as the weight rules shard the parameter."""
    from actorcore.mcore.convert.transforms import shard_for_tp, shard_sections

    if name.endswith(("conv1d.weight", "in_proj_qkv.weight")):
        key = hf_config.linear_num_key_heads * hf_config.linear_key_head_dim
        value = hf_config.linear_num_value_heads * hf_config.linear_value_head_dim
        return shard_sections(full, [key, key, value], tp_rank, tp_size)
    if name.endswith("norm.weight"):
        return full
    return shard_for_tp(full, "row" if name.endswith("out_proj.weight") else "column", tp_rank, tp_size)


def _case(model_type: str, tp: int, pp: int, ep: int, directory: str) -> dict:
    from safetensors.torch import load_file

    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import checkpoint_expert_layout, load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict

    hf = tiny_hf(model_type)
    parallel = McoreParallel(tp=tp, pp=pp, ep=ep)
    context = initialize_megatron(parallel)
    model = build_gpt_model(hf.config, parallel, expert_layout=checkpoint_expert_layout(directory, hf.config))
    load_hf_into_mcore(model, directory)
    traces = [m for chunk in model.chunks for m in chunk.modules() if type(m).__name__ == "PackedGatedDeltaNet"]
    for module in traces:
        module.trace = Counter()
    batches = _batches(pad_to=32 if pp > 1 else None)
    got = compute_logprobs(model, batches)
    with torch.no_grad():
        ref = [hybrid_reference(hf, s) for s in hybrid_sequences()]

    fb = compute_logprobs(model, batches, loss_fn=lambda out, batch: -out.log_probs.sum())
    hf.zero_grad()
    for sequences in hybrid_sequences():
        (hybrid_reference(hf, sequences)[0].sum() * (-1.0 / len(LENGTHS))).backward()
    grads = {}
    for chunk in model.chunks:
        first = chunk.decoder.layers[0].layer_number == 1 if len(chunk.decoder.layers) else False
        for name, param in chunk.named_parameters():
            if name == "decoder.final_layernorm.weight" and not model.config.sequence_parallel:
                grads["model.norm.weight"] = (param.grad.clone(), hf.model.norm.weight.grad.clone())
            if first and name == "decoder.layers.0.input_layernorm.weight" and not model.config.sequence_parallel:
                grads["model.layers.0.input_layernorm.weight"] = (
                    param.grad.clone(), hf.model.layers[0].input_layernorm.weight.grad.clone())
            if first and name.startswith(GDN):
                hf_name = "model.layers.0.linear_attn." + name[len(GDN):]
                full = hf.get_parameter(hf_name).grad
                grads[hf_name] = (param.grad.clone(), _local_grad(name, full, hf.config, context.tp_rank,
                                                                  context.tp_size))
    state = gather_hf_state_dict(model)
    stored = load_file(os.path.join(directory, "model.safetensors"))
    return {"got": [(o.log_probs, o.entropy) for o in got], "fb": [o.log_probs for o in fb], "ref": ref,
            "grads": grads, "traces": [dict(m.trace) for m in traces],
            "roundtrip": sorted(state) == sorted(stored) and all(torch.equal(state[k], v) for k, v in stored.items())}


def _leak_case(model_type: str, leak: str, directory: str) -> dict:
    """Megatron at TP=2: the packed batch vs each sequence alone, and (to show the one path is live) the same
    sequence with its first token changed."""
    import actorcore as ac
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import checkpoint_expert_layout, load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    hf = tiny_hf(model_type, leak)
    parallel = McoreParallel(tp=2)
    initialize_megatron(parallel)
    model = build_gpt_model(hf.config, parallel, expert_layout=checkpoint_expert_layout(directory, hf.config))
    load_hf_into_mcore(model, directory)
    sequences = hybrid_sequences()[0]
    packed = compute_logprobs(model, ac.pack(sequences)).log_probs
    alone = torch.cat([compute_logprobs(model, ac.pack([s])).log_probs for s in sequences])
    changed = sequences[1].clone()
    changed[0] = 3 if changed[0] != 3 else 4
    base = compute_logprobs(model, ac.pack([sequences[1]])).log_probs
    moved = compute_logprobs(model, ac.pack([changed])).log_probs
    return {"packed": packed, "alone": alone, "within": (base[2:] - moved[2:]).abs().max()}


def _save_case(directory: str, saved: str) -> bool:
    """Megatron's distributed checkpoint of Qwen3.5 saved at TP=2."""
    from actorcore.mcore.convert.dist_checkpoint import save_mcore_checkpoint
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    hf = tiny_hf("qwen3_5_text")
    initialize_megatron(McoreParallel(tp=2))
    model = build_gpt_model(hf.config, McoreParallel(tp=2))
    load_hf_into_mcore(model, directory)
    save_mcore_checkpoint(model, saved, directory)
    return True


def _reload_case(directory: str, saved: str) -> bool:
    """... loaded at TP=1 (two data-parallel ranks): the exported weights are the HF checkpoint's, bitwise."""
    from safetensors.torch import load_file

    from actorcore.mcore.convert.dist_checkpoint import load_mcore_checkpoint
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict

    hf = tiny_hf("qwen3_5_text")
    initialize_megatron(McoreParallel())
    model = build_gpt_model(hf.config, McoreParallel())
    load_mcore_checkpoint(model, saved)
    state = gather_hf_state_dict(model)
    stored = load_file(os.path.join(directory, "model.safetensors"))
    return sorted(state) == sorted(stored) and all(torch.equal(state[k], v) for k, v in stored.items())


def _mtp_dropped_case(directory: str) -> bool:
    """A checkpoint with the released models' ``mtp.*`` tensors loads (they are dropped) and exports without them."""
    from safetensors.torch import load_file

    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict

    hf = tiny_hf("qwen3_5_text")
    initialize_megatron(McoreParallel(tp=2))
    model = build_gpt_model(hf.config, McoreParallel(tp=2))
    load_hf_into_mcore(model, directory)
    state = gather_hf_state_dict(model)
    stored = {k: v for k, v in load_file(os.path.join(directory, "model.safetensors")).items()
              if not k.startswith("mtp.")}
    return sorted(state) == sorted(stored) and all(torch.equal(state[k], v) for k, v in stored.items())


def _save_with_mtp_tensors(source: str, directory: str) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


# (model_type, tp, pp, ep) by case name
_CASES = {
    "qwen3_5_text_tp2": ("qwen3_5_text", 2, 1, 1),
    "qwen3_5_text_pp2": ("qwen3_5_text", 1, 2, 1),
    "qwen3_5_moe_text_ep2": ("qwen3_5_moe_text", 1, 1, 2),
    "qwen3_5_moe_text_tp2": ("qwen3_5_moe_text", 2, 1, 1),  # MoE at TP=2 runs under sequence parallelism
    "qwen3_next_tp2": ("qwen3_next", 2, 1, 1),
    "qwen3_next_pp2": ("qwen3_next", 1, 2, 1),
    "qwen3_next_ep2": ("qwen3_next", 1, 1, 2),
}
_LEAKS = [(m, leak) for m in ("qwen3_5_text", "qwen3_next") for leak in ("conv", "delta_rule")]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mcore_hybrid"))
    cases = []
    for name, (model_type, tp, pp, ep) in _CASES.items():
        directory = os.path.join(root, model_type)
        if not os.path.isdir(directory):
            tiny_hf(model_type).save_pretrained(directory)
        cases.append((name, _case, (model_type, tp, pp, ep, directory)))
    for model_type, leak in _LEAKS:
        directory = os.path.join(root, f"{model_type}_{leak}")
        tiny_hf(model_type, leak).save_pretrained(directory)
        cases.append((f"leak_{model_type}_{leak}", _leak_case, (model_type, leak, directory)))
    _save_with_mtp_tensors(os.path.join(root, "qwen3_5_text"), os.path.join(root, "with_mtp"))
    cases.append(("mtp_dropped", _mtp_dropped_case, (os.path.join(root, "with_mtp"),)))
    saved = os.path.join(root, "dist_ckpt")
    cases += [("dist_save", _save_case, (os.path.join(root, "qwen3_5_text"), saved)),
              ("dist_reload", _reload_case, (os.path.join(root, "qwen3_5_text"), saved))]
    return spawn_cases(2, cases)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_CASES))
def test_hybrid_logprobs_grads_roundtrip(world2, name):
    tol, grad_tol = TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"]
    projections = {"separate": {"in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"},
                   "grouped": {"in_proj_qkvz.weight", "in_proj_ba.weight"}}
    model_type = _CASES[name][0]
    expected_grads = {"conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"} | projections[
        get_spec(model_type).linear_attention.projections]
    seen, traces = set(), []
    for rank, result in enumerate(world2[name]):
        assert result["roundtrip"], f"rank {rank}: Megatron -> HF export differs from the checkpoint"
        for (lp, ent), (ref_lp, ref_ent), fb in zip(result["got"], result["ref"], result["fb"]):
            assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0)
            torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0)
        for hf_name, (grad, ref_grad) in result["grads"].items():
            seen.add(hf_name.rsplit("linear_attn.", 1)[-1])
            torch.testing.assert_close(grad, ref_grad, atol=grad_tol * ref_grad.abs().max(), rtol=0,
                                       msg=f"rank {rank} {hf_name}")
        traces += result["traces"]
    assert traces, f"{name}: no PackedGatedDeltaNet on any rank"
    for trace in traces:  # actorcore's packed kernels ran in every linear-attention layer
        assert trace.get("causal_conv1d:torch", 0) > 0 and trace.get("gated_delta_rule:torch", 0) > 0
    assert expected_grads <= seen, f"{name}: no gradients compared for {expected_grads - seen}"


@pytest.mark.slow
@pytest.mark.parametrize("model_type,leak", _LEAKS)
def test_hybrid_no_state_leak(world2, model_type, leak):
    """Only the conv (``leak="conv"``) or only the delta rule (``"delta_rule"``) carries information between
    tokens: a packed batch equals each sequence alone, and that path does carry it within a sequence."""
    for result in world2[f"leak_{model_type}_{leak}"]:
        torch.testing.assert_close(result["packed"], result["alone"], atol=TOL["mcore_vs_hf_fp32"], rtol=0)
        assert result["within"] > 1e-3, "the only path between tokens carries nothing: the test could not fail"


@pytest.mark.slow
def test_hybrid_distributed_checkpoint_changes_tp(world2):
    """Saved at TP=2, loaded at TP=1: the sectioned ``[q; k; v]`` tensors are stored as three tensors."""
    assert world2["dist_save"] == [True, True]
    assert world2["dist_reload"] == [True, True]


@pytest.mark.slow
def test_hybrid_checkpoint_mtp_tensors_dropped(world2):
    assert world2["mtp_dropped"] == [True, True]
