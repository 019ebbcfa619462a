"""GLM-4.5 / 4.6 (``glm4_moe``) on the Megatron route, what is specific to it (the round trips at TP / PP / EP and
the MTP layers are in the registry-driven test_mcore_roundtrip.py and test_mcore_mtp.py):

- its partial RoPE: transformers' Glm4Moe rotates the first half of each head's dims in halves, exactly Megatron's
  ``rotary_percent`` layout (per token, against transformers' own rotary functions), so q / k rows convert as is;
- its config mapping both ways, and the refusals of what Megatron-Core would compute differently;
- per-token log-probs, entropy and every parameter's gradient through the Megatron route at TP=2 x EP=2 and
  TP=2 x EP=1 (with sequence parallelism), PP=2 (log-probs, entropy, norm gradients), EP=2 and CP=2 against the
  model's own transformers forward in fp32 (gloo, one spawn);
- at TP=2 x EP=2 in bf16, forward-backward under Megatron's combined 1F1B schedule
  (``overlap_moe_expert_parallel_comm``) equals the plain schedule bit for bit (log-probs, entropy, every
  gradient), and transformers' fp32 forward per token.

The tiny config sets every field that shapes the computation away from its default: partial rotary 0.5, q/k norms,
q/k/v biases, first_k_dense_replace=1, n_group=2 / topk_group=1, routed_scaling_factor=2.5, one shared expert,
an MTP layer; the norms and the score-correction bias are randomised."""

from __future__ import annotations

import os

import pytest
import torch

from support.mcore_cases import spawn_cases
from actorcore.testing.tolerances import TOL
from support.mcore_glm4_moe import schedules_plain_and_overlapped


pytest.importorskip("megatron.core")


def _rotated(interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(Megatron's rotated q, transformers' rotated q) for the tiny config's heads, 13 positions."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.glm4_moe import modeling_glm4_moe as glm

    from actorcore.mcore.build.config import gpt_model_args
    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.testing.tiny_configs import tiny_config

    config = tiny_config("glm4_moe")
    args = gpt_model_args(config)
    positions = 13
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, config.num_attention_heads, positions, config.head_dim, generator=gen)
    rotary = RotaryEmbedding(kv_channels=config.head_dim, rotary_percent=args["rotary_percent"],
                             rotary_base=args["rotary_base"], rotary_interleaved=interleaved,
                             use_cpu_initialization=True)
    with CpuRuntime():  # get_emb moves the frequencies to "the current CUDA device"
        freqs = rotary.get_emb(positions)  # [S, 1, 1, rot_dim]: the table before any CP split
    ours = _apply_rotary_pos_emb_bshd(q.permute(2, 0, 1, 3), freqs, rotary_interleaved=interleaved)
    cos, sin = glm.Glm4MoeRotaryEmbedding(config)(q, torch.arange(positions)[None])
    theirs, _ = glm.apply_rotary_pos_emb(q, q, cos, sin)
    return ours.permute(1, 2, 0, 3), theirs


def test_partial_rope_layout_is_megatrons_per_token():
    """rotary_percent = partial_rotary_factor, non-interleaved: equal per token and head; the second half of each
    head passes through. (Interleaved pairs, GLM-4's layout, would differ: the check can fail.)"""
    from actorcore.mcore.build.config import gpt_model_args
    from actorcore.testing.tiny_configs import tiny_config

    assert gpt_model_args(tiny_config("glm4_moe"))["rotary_percent"] == 0.5
    ours, theirs = _rotated(interleaved=False)
    torch.testing.assert_close(ours, theirs, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
    wrong, _ = _rotated(interleaved=True)
    assert (wrong - theirs)[..., :8].abs().max() > 0.1
    torch.testing.assert_close(wrong[..., 8:], theirs[..., 8:], atol=0, rtol=0)


def test_config_maps_both_ways_and_refuses_what_differs():
    from transformers import AutoConfig

    from actorcore.mcore.build.config import UnsupportedConfigError, gpt_model_args, hf_to_mcore_config, mcore_to_hf_config
    from actorcore.testing.tiny_configs import tiny_config

    hf = tiny_config("glm4_moe")
    tc = hf_to_mcore_config(hf)
    expected = dict(qk_layernorm=True, add_qkv_bias=True, add_bias_linear=False, moe_layer_freq=[0, 1],
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.0, moe_router_num_groups=2, moe_router_group_topk=1,
                    moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=40,
                    moe_router_dtype="fp32", kv_channels=16, mtp_num_layers=1)
    assert {k: getattr(tc, k) for k in expected} == expected
    back = mcore_to_hf_config(tc, gpt_model_args(hf), "glm4_moe", vocab_size=hf.vocab_size)
    assert back["rope_parameters"] == hf.rope_parameters and back["use_qk_norm"] and back["attention_bias"]
    rebuilt = AutoConfig.for_model("glm4_moe", **back)
    assert (rebuilt.first_k_dense_replace, rebuilt.n_shared_experts, rebuilt.num_nextn_predict_layers) == (1, 1, 1)
    # Both switches off: plain attention (no o_proj bias either way).
    plain = hf_to_mcore_config(tiny_config("glm4_moe", use_qk_norm=False, attention_bias=False))
    assert (plain.qk_layernorm, plain.add_qkv_bias) == (False, False)
    with pytest.raises(UnsupportedConfigError, match="norm_topk_prob"):
        hf_to_mcore_config(tiny_config("glm4_moe", norm_topk_prob=False))
    with pytest.raises(UnsupportedConfigError, match="num_experts_per_tok=1"):
        hf_to_mcore_config(tiny_config("glm4_moe", num_experts_per_tok=1, n_group=1, topk_group=1))
    with pytest.raises(UnsupportedConfigError, match="ranks groups"):
        hf_to_mcore_config(tiny_config("glm4_moe", n_group=2, topk_group=2))


# (name, tp, pp, cp, ep) of the two-rank cases with every gradient checked.
LAYOUTS = (("ep2", 1, 1, 1, 2), ("cp2", 1, 1, 2, 1))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Every two-rank case in one spawn: TP=2 (x EP=2) with sequence parallelism (test_mcore_moe_tp's case), PP=2
    (test_mcore_logprobs' case: batches padded to a common length), EP=2 and CP=2 (test_mcore_cp's case: every
    gradient reduced as Megatron's DDP does)."""
    import support.mcore_cp as cp
    import support.mcore_logprobs as logprobs
    import support.mcore_moe_tp as moe_tp
    from support.mcore_logprobs import tiny_hf

    root = str(tmp_path_factory.mktemp("mcore_glm4_moe"))
    directory = os.path.join(root, "glm4_moe")
    tiny_hf("glm4_moe").save_pretrained(directory)
    layout_dir = os.path.join(root, "layouts")
    hf = cp.cp_tiny_hf("glm4_moe", {})
    hf.save_pretrained(layout_dir)
    # TP=2 x EP=2 over the same two ranks, as test_mcore_moe_tp.py trains MoE at TP=2.
    cases = [("tp2", moe_tp.moe_tp_case, ("glm4_moe", 2, {}, directory)),
             ("tp2_ep1", moe_tp.moe_tp_case, ("glm4_moe", 1, {}, directory)),  # experts replicated over the TP ranks
             ("pp2", logprobs.logprobs_case, ("glm4_moe", 1, 2, 1, directory, {}))]
    cases += [(name, cp.cp_layout, ("glm4_moe", tp, pp, c, ep, layout_dir)) for name, tp, pp, c, ep in LAYOUTS]
    cases.append(("ep_overlap", schedules_plain_and_overlapped, (layout_dir,)))
    results = spawn_cases(2, cases)
    results["reference"] = cp.cp_reference(hf)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "tp2_ep1"])
def test_tp2_sequence_parallel_logprobs_and_every_gradient(world2, name):
    """TP=2 x EP=2 and TP=2 x EP=1 (each rank routes only its own tokens through all experts: the expert
    gradients are summed over Megatron's expert data parallel group by its DDP, mcore/build/expert_grads.py)."""
    tol, grad_tol = TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"]
    for rank, result in enumerate(world2[name]):
        assert result["sp"] and result["seen_tokens"] == result["sp_tokens"]
        for (lp, ent), (ref_lp, ref_ent), fb in zip(result["got"], result["ref"], result["fb"]):
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0)
            torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0)
        _check_grads(result["grads"], result["ref_grads"], grad_tol, f"rank {rank} {name}")


@pytest.mark.slow
def test_pp2_logprobs_and_norm_gradients(world2):
    """The first stage holds the dense layer, the last the MoE layer and the head."""
    from support.mcore_logprobs import check_logprobs

    check_logprobs(world2["pp2"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS])
def test_layout_logprobs_and_every_gradient(world2, name):
    tol, grad_tol = TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"]
    ref_out, ref_grads = world2["reference"]
    for rank, result in enumerate(world2[name]):
        where = f"rank {rank} {name}"
        if name == "cp2":  # every attention call (2 layers, 3 batches, twice) took the context-parallel path
            assert result["trace"] == {"varlen_attention:at_positions": 2 * 3 * 2}, where
        for (lp, ent), fb, (ref_lp, ref_ent) in zip(result["got"], result["fb"], ref_out):
            assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape, where
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0, msg=where)
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0, msg=where)
            torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0, msg=where)
        _check_grads(result["grads"], ref_grads, grad_tol, where)


def _check_grads(grads: dict, ref_grads: dict, grad_tol: float, where: str) -> None:
    # The q/k norms, the q/k/v biases, the router, the shared expert and the dense layer all receive gradients.
    for part in ("self_attn.q_norm.weight", "self_attn.k_proj.bias", "mlp.gate.weight",
                 "mlp.shared_experts.up_proj.weight", "layers.0.mlp.gate_proj.weight"):
        assert any(part in name for name in ref_grads), part
    assert set(ref_grads) <= set(grads), (where, sorted(set(ref_grads) - set(grads)))
    for name, ref_grad in ref_grads.items():
        scale = ref_grad.abs().max()  # 0 only for an expert no token was routed to: then exactly 0
        torch.testing.assert_close(grads[name], ref_grad, atol=grad_tol * scale, rtol=0,
                                   msg=lambda m, name=name: f"{where} {name}: {m}")


@pytest.mark.slow
def test_ep_overlap_schedule_equals_plain_and_transformers(world2):
    """The combined 1F1B schedule ran (one schedule plan per micro-batch) and computed exactly what the plain
    schedule does; both follow transformers' fp32 forward to bf16 rounding."""
    tol = TOL["mcore_bf16_vs_hf_fp32"]
    ref_out, _ = world2["reference"]
    for rank, result in enumerate(world2["ep_overlap"]):
        plain, overlapped = result["plain"], result["overlapped"]
        assert (plain["plans"], overlapped["plans"]) == (0, len(ref_out)), rank
        for (lp, ent), (plain_lp, plain_ent), (ref_lp, ref_ent) in zip(overlapped["out"], plain["out"], ref_out):
            torch.testing.assert_close(lp, plain_lp, atol=0, rtol=0)
            torch.testing.assert_close(ent, plain_ent, atol=0, rtol=0)
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0)
        assert sorted(overlapped["grads"]) == sorted(plain["grads"]) and any("experts" in n for n in plain["grads"])
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(overlapped["grads"][name], grad, atol=0, rtol=0, msg=f"rank {rank} {name}")
