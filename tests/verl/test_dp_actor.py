"""verl's own actor and critic code drive actorcore's ``apply_monkey_patch``: verl 0.7.1's
``DataParallelPPOActor._forward_micro_batch`` (remove-padding, with and without fused kernels) and
``DataParallelPPOCritic._forward_micro_batch``, in one process and under Ulysses SP on 2 gloo ranks with verl's own
Ulysses group, on tiny models on the CPU. Per response token, log-probs, entropy and values equal the unpatched
model run one sequence at a time.

Installs nothing: skipped where ``verl.workers.actor.dp_actor`` cannot be imported (verl 0.7.1 installed with
``--no-deps`` still imports ray, tensordict, omegaconf, codetiming and more at module level); the install used is
in tests/verl/README.md.
"""

import pytest
from verl_required import import_verl_or_skip
import torch

import_verl_or_skip("verl.workers.actor.dp_actor", "0.7",
                    reason="verl (0.7.x, with the modules it imports) not installed")

from actorcore.testing.distributed import run_distributed  # noqa: E402
from actorcore.testing.tolerances import TOL  # noqa: E402
from rollout_layout import padded_rollout  # noqa: E402

PROMPTS = (3, 5, 1)  # prompt lengths, left-padded to 5
RESPONSES = (6, 2, 4)  # response lengths, right-padded to 6
TEMPERATURE = 0.7


def _micro_batch():
    return padded_rollout(PROMPTS, RESPONSES, seed=17)


def _reference(model):
    """Per sequence, plain HF: log p(response token) and entropy of the distribution that predicts it."""
    batch, P = _micro_batch(), max(PROMPTS)
    lps, ents = [], []
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            seq = batch["input_ids"][i, P - p:P + r]
            logp = torch.log_softmax(model(input_ids=seq[None]).logits[0] / TEMPERATURE, -1)[p - 1:p + r - 1]
            lps.append(logp.gather(-1, seq[p:, None])[:, 0])
            ents.append(-(logp.exp() * logp).sum(-1))
    return lps, ents


def _actor(model, sp, fused, remove_padding=True):
    from omegaconf import OmegaConf
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    config = OmegaConf.create({
        "use_remove_padding": remove_padding, "use_fused_kernels": fused, "ulysses_sequence_parallel_size": sp,
        "use_dynamic_bsz": False, "use_prefix_grouper": False, "entropy_from_logits_with_chunking": False,
        "use_torch_compile": False, "entropy_checkpointing": False, "fsdp_config": {"dtype": "float32"},
    })
    return DataParallelPPOActor(config, model)


def _use_verls_torch_padding_helpers():
    """verl dispatches unpad_input / pad_input to flash_attn (CUDA) or to its own pure-torch copy (NPU); there is
    no flash_attn on the CPU, so point the dispatcher at verl's pure-torch copy (same functions as flash_attn's)."""
    from verl.utils import attention_utils, npu_flash_attn_utils as torch_copy

    helpers = (torch_copy.index_first_axis, torch_copy.pad_input, torch_copy.rearrange, torch_copy.unpad_input)
    attention_utils._get_attention_functions = lambda: helpers


def _worker(rank, world_size):
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from actorcore.compat.verl import apply_monkey_patch
    from actorcore.testing.tiny_configs import build_tiny_model

    _use_verls_torch_padding_helpers()
    if world_size > 1:
        set_ulysses_sequence_parallel_group(dist.new_group(list(range(world_size))))
    reference = build_tiny_model("qwen2", seed=3)
    want_lp, want_ent = _reference(reference)
    results = {}
    for fused in (True, False):
        model = build_tiny_model("qwen2", seed=3)
        apply_monkey_patch(model, ulysses_sp_size=world_size, use_remove_padding=True, use_fused_kernels=fused)
        out = _actor(model, world_size, fused)._forward_micro_batch(_micro_batch(), temperature=TEMPERATURE,
                                                                    calculate_entropy=True)
        lp, ent = out["log_probs"].detach(), out["entropys"].detach()
        results[fused] = max(max((lp[i, :r] - want_lp[i]).abs().max().item(),
                                 (ent[i, :r] - want_ent[i]).abs().max().item()) for i, r in enumerate(RESPONSES))
    results["critic"] = _critic_worst(world_size)
    if world_size == 1:  # verl's padded path (Ulysses needs remove-padding)
        results.update(_padded_fused_worst(want_lp, want_ent))
    return results


def _padded_fused_worst(want_lp, want_ent):
    """``use_remove_padding=False`` with fused kernels: verl's padded [B, S] micro-batch through actorcore's patch,
    against plain transformers one sequence at a time and against verl's own padded path (the unpatched model's
    logits, verl's log-softmax)."""
    from actorcore.compat.verl import apply_monkey_patch
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("qwen2", seed=3)
    apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=False, use_fused_kernels=True)
    got = _actor(model, 1, True, remove_padding=False)._forward_micro_batch(
        _micro_batch(), temperature=TEMPERATURE, calculate_entropy=True)
    verls = _actor(build_tiny_model("qwen2", seed=3), 1, False, remove_padding=False)._forward_micro_batch(
        _micro_batch(), temperature=TEMPERATURE, calculate_entropy=True)
    lp, ent = got["log_probs"].detach(), got["entropys"].detach()
    vs_plain = max(max((lp[i, :r] - want_lp[i]).abs().max().item(), (ent[i, :r] - want_ent[i]).abs().max().item())
                   for i, r in enumerate(RESPONSES))
    vs_verl = max(max((lp[i, :r] - verls["log_probs"][i, :r]).abs().max().item(),
                      (ent[i, :r] - verls["entropys"][i, :r]).abs().max().item()) for i, r in enumerate(RESPONSES))
    return {"padded_fused_vs_plain": vs_plain, "padded_fused_vs_verl_padded": vs_verl}


def _critic_worst(world_size):
    """verl 0.7.1's DataParallelPPOCritic._forward_micro_batch: values of the response tokens' predecessors. Its
    forward runs under a bf16 CPU autocast; a float64 model is left alone by autocast, so the comparison is exact
    up to actorcore's float32 value head."""
    from omegaconf import OmegaConf
    from verl.workers.critic.dp_critic import DataParallelPPOCritic

    from actorcore.compat.verl import apply_monkey_patch
    from actorcore.testing.tiny_configs import build_tiny_model

    batch, P = _micro_batch(), max(PROMPTS)
    reference = build_tiny_model("llama", task="token_classification", seed=8, dtype=torch.float64)
    model = build_tiny_model("llama", task="token_classification", seed=8, dtype=torch.float64)
    apply_monkey_patch(model, ulysses_sp_size=world_size, use_remove_padding=True)
    config = OmegaConf.create({"model": {"use_remove_padding": True}, "ulysses_sequence_parallel_size": world_size})
    values = DataParallelPPOCritic(config, model, None)._forward_micro_batch(batch).detach()
    worst = 0.0
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            seq = batch["input_ids"][i, P - p:P + r]
            want = reference(input_ids=seq[None]).logits[0, p - 1:p + r - 1, 0]  # verl: values[:, -R - 1:-1]
            worst = max(worst, (values[i, :r] - want).abs().max().item())
    return worst


@pytest.mark.parametrize("world_size", [1, 2])
def test_verl_dp_actor_and_critic_forward_micro_batch_match_plain_hf(world_size):
    for rank, res in enumerate(run_distributed(_worker, world_size)):
        for path, worst in res.items():
            assert worst <= TOL["packed_vs_hf_fp32"], f"rank {rank} {path} (True/False: fused): max |Δ| {worst:.2e}"
        if world_size == 1:
            assert {"padded_fused_vs_plain", "padded_fused_vs_verl_padded"} <= set(res)
