"""The Megatron route's loss-fused head (``actorcore.mcore.compute_loss``) on gloo, every case in one spawn of 2
processes: a PPO-clip style loss with token args of shape ``[T]`` (advantages) and ``[T, 2]`` (old log-probs and
per-token weights), on ragged packs with a 1-token sequence, for dense Qwen3 and Qwen3-MoE, at temperatures 1 and 0.8.

- Without model parallelism (each of the 2 ranks a data-parallel replica on the same batches, its local gradients
  the one-process ones) and at PP=2 (the loss on the last stage, every pack padded to one token count): per-token
  log-probs and entropies equal the model's own transformers forward in fp32, each pack's loss equals the
  reference's sum of the same token losses, and every parameter's gradient equals the reference's gradient of
  those losses averaged over the packs (Megatron's averaging over micro-batches).
- The same within fp32 rounding of ``compute_logprobs(loss_fn=...)`` with the summed token losses, and the call's
  trace proves the fused head ran (``mcore:fused_loss``, the fused kernel's chunks) where ``compute_logprobs`` did
  not run it.
- Refused with ``ValueError``: TP=2, CP=2, a critic; token args of the wrong length or count.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from support.mcore_cases import spawn_cases
from actorcore.testing.tolerances import TOL


pytest.importorskip("megatron.core")

# (model_type, pp, temperature) of the compared cases.
CASES = {"qwen3": ("qwen3", 1, 1.0), "qwen3_moe": ("qwen3_moe", 1, 0.8), "qwen3_pp2": ("qwen3", 2, 0.8),
         "qwen3_moe_pp2": ("qwen3_moe", 2, 1.0)}
PP_PAD = 32  # every pack's token count at PP=2 (Megatron's pipeline exchanges fixed shapes)


def ppo_clip(logprob, entropy, advantages, old_and_weight):
    """Token-wise PPO-clip, weighted per token, with an entropy bonus (nonzero where the token args are zero: the
    positions that score nothing must be dropped, not trusted to give 0)."""
    old, weight = old_and_weight[:, 0], old_and_weight[:, 1]
    ratio = torch.exp(logprob - old)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    return -surrogate * weight - 0.01 * entropy


def _scored(batch) -> torch.Tensor:
    """``[T_real]`` True at every token a position before it scores (not a sequence's first token)."""
    scored = torch.ones(batch.num_real_tokens, dtype=torch.bool)
    scored[batch.cu_seqlens[: batch.num_sequences + 1][:-1].long()] = False
    return scored


def _token_args(reference_lp: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per pack: advantages ``[T]`` and (old log-probs near the reference's, so the clip binds on both sides;
    per-token weights) ``[T, 2]``."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for lp in reference_lp:
        n = lp.numel()
        old = lp.detach() + 0.3 * torch.randn(n, generator=gen)
        weight = (torch.rand(n, generator=gen) > 0.2).float() / 10.0
        out.append((torch.randn(n, generator=gen), torch.stack([old, weight], dim=1)))
    return out


def _reference_logprobs(hf, sequences, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    from actorcore.testing.reference import reference_logprobs, right_padded

    return reference_logprobs(hf, *right_padded(sequences), temperature)


def _reference(hf, sequences_per_pack, token_args, temperature: float) -> dict:
    """The model's own padded transformers forward (fp32): per pack log-probs, entropies and the summed token
    losses; gradients of the losses averaged over the packs."""
    import actorcore as ac

    hf.zero_grad(set_to_none=True)
    lps, ents, losses, scales = [], [], [], []
    for sequences, args in zip(sequences_per_pack, token_args):
        lp, ent = _reference_logprobs(hf, sequences, temperature)
        token_losses = torch.where(_scored(ac.pack(sequences)), ppo_clip(lp, ent, *args), 0.0)
        (token_losses.sum() / len(sequences_per_pack)).backward()
        lps.append(lp.detach())
        ents.append(ent.detach())
        losses.append(token_losses.sum().detach())
        scales.append(token_losses.abs().sum().detach())
    grads = {name: p.grad.clone() for name, p in hf.named_parameters() if p.grad is not None}
    return {"lp": lps, "ent": ents, "loss": losses, "loss_scale": scales, "grads": grads}


def _compare_case(model_type: str, pp: int, temperature: float, directory: str) -> dict:
    from support.mcore_logprobs import logprob_batches, logprob_sequences, tiny_hf

    from actorcore.mcore import compute_logprobs, compute_loss
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    hf = tiny_hf(model_type)
    parallel = McoreParallel(pp=pp)
    initialize_megatron(parallel)
    model = build_gpt_model(hf.config, parallel)
    load_hf_into_mcore(model, directory)
    batches = logprob_batches(pad_to=PP_PAD if pp > 1 else None)
    sequences = logprob_sequences()
    with torch.no_grad():
        token_args = _token_args([_reference_logprobs(hf, s, temperature)[0] for s in sequences])

    trace = Counter()
    fused = compute_loss(model, batches, ppo_clip, token_args, temperature, trace=trace)
    fused_grads = _taken_grads(model)
    order = iter(token_args)  # the last stage's loss calls come in micro-batch order

    def summed(out, batch):
        return torch.where(_scored(batch), ppo_clip(out.log_probs, out.entropy, *next(order)), 0.0).sum()

    plain_trace = Counter()
    plain = compute_logprobs(model, batches, temperature, loss_fn=summed, trace=plain_trace)
    plain_grads = _taken_grads(model)
    poisoned = [tuple(_poison_starts(a, b) for a in args) for args, b in zip(token_args, batches)]
    return {"fused": [(o.loss, o.logprob, o.entropy) for o in fused], "fused_grads": fused_grads,
            "plain": [(o.log_probs, o.entropy) for o in plain], "plain_grads": plain_grads,
            "poisoned_loss": [o.loss for o in compute_loss(model, batches, ppo_clip, poisoned, temperature)],
            "trace": dict(trace), "plain_trace": dict(plain_trace), "pp_rank": model.context.pp_rank,
            "ref": _reference(hf, sequences, token_args, temperature)}


def _taken_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, HF-named (copies), then cleared for the next call."""
    from support.mcore_moe_tp import grads_as_hf

    grads = {name: grad.clone() for name, grad in grads_as_hf(model).items()}
    for chunk in model.chunks:
        chunk.zero_grad(set_to_none=True)
    return grads


def _poison_starts(arg: torch.Tensor, batch) -> torch.Tensor:
    """``arg`` with huge rows at every sequence's first token, which nothing scores."""
    out = arg.clone()
    out[~_scored(batch)] = 1e6
    return out


def _refusal(fn) -> str:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return ""


def _refusals_case(directory: str) -> dict:
    """TP=2, CP=2 and a critic (each built on the 2 ranks), and bad token args on a model that runs."""
    from megatron.core import parallel_state

    import actorcore as ac
    from support.mcore_logprobs import logprob_batches, tiny_hf

    from actorcore.mcore import compute_loss
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    config = tiny_hf("qwen3").config
    batches = logprob_batches()
    args = [(torch.zeros(b.num_real_tokens),) for b in batches]
    loss = ppo_clip
    out = {}
    for name, parallel, options in (("tp2", McoreParallel(tp=2), {}), ("cp2", McoreParallel(cp=2), {}),
                                    ("critic", McoreParallel(), {"value_head": True})):
        initialize_megatron(parallel)
        model = build_gpt_model(config, parallel, **options)
        out[name] = _refusal(lambda: compute_loss(model, batches, loss, args))
        parallel_state.destroy_model_parallel()
    initialize_megatron(McoreParallel())
    model = build_gpt_model(config, McoreParallel())
    short = [(torch.zeros(b.num_real_tokens - 1),) for b in batches]
    out["short"] = _refusal(lambda: compute_loss(model, batches, loss, short))
    out["count"] = _refusal(lambda: compute_loss(model, batches, loss, args[:-1]))
    out["flat"] = _refusal(lambda: compute_loss(model, batches, loss, args[0]))
    out["single_bare"] = _refusal(lambda: compute_loss(model, batches[0], loss, args[0][0]))
    out["arity"] = _refusal(lambda: compute_loss(model, batches, loss, [args[0], (), args[2]]))
    out["not_a_model"] = _refusal(lambda: compute_loss(model.chunks[0], batches, loss, args))
    out["empty"] = _refusal(lambda: compute_loss(model, [], loss))
    out["single"] = compute_loss(model, ac.pack([torch.tensor([5, 9, 11])]), lambda lp, ent: -lp)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    from support.mcore_logprobs import tiny_hf

    root = str(tmp_path_factory.mktemp("mcore_loss"))
    for model_type in {m for m, _, _ in CASES.values()}:
        tiny_hf(model_type).save_pretrained(os.path.join(root, model_type))
    cases = [(name, _compare_case, (model_type, pp, temperature, os.path.join(root, model_type)))
             for name, (model_type, pp, temperature) in CASES.items()]
    cases.append(("refusals", _refusals_case, (os.path.join(root, "qwen3"),)))
    return spawn_cases(2, cases)


def _close_rel(got: dict, want: dict, tol: float, where: str) -> None:
    assert set(want) <= set(got), (where, sorted(set(want) - set(got)))
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, atol=tol * ref.abs().max(), rtol=0, msg=f"{where} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_compute_loss_equals_transformers_per_token_loss_and_gradient(world2, name):
    tol = TOL["mcore_vs_hf_fp32"]
    for rank, result in enumerate(world2[name]):
        where, ref = f"{name} rank {rank}", result["ref"]
        for (loss, lp, ent), ref_lp, ref_ent, ref_loss, scale in zip(result["fused"], ref["lp"], ref["ent"],
                                                                      ref["loss"], ref["loss_scale"]):
            assert lp.dtype == ent.dtype == loss.dtype == torch.float32 and loss.shape == () and lp.shape == ref_lp.shape
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0, msg=where)
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0, msg=where)
            torch.testing.assert_close(loss, ref_loss, atol=TOL["mcore_loss_sum_vs_hf_fp32_rel"] * scale, rtol=0,
                                       msg=where)
        _close_rel(result["fused_grads"], ref["grads"], TOL["grad_mcore_vs_hf_fp32_rel"], where)
        # rows of the token args at sequence starts move to positions that score nothing: their losses are dropped
        assert [loss for loss, _, _ in result["fused"]] == result["poisoned_loss"], where


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_compute_loss_equals_compute_logprobs_with_the_summed_loss(world2, name):
    tol, grad_tol = TOL["mcore_fused_loss_vs_logprobs_fp32"], TOL["grad_mcore_fused_loss_vs_logprobs_fp32_rel"]
    for rank, result in enumerate(world2[name]):
        where = f"{name} rank {rank}"
        for (_, lp, ent), (plain_lp, plain_ent) in zip(result["fused"], result["plain"]):
            torch.testing.assert_close(lp, plain_lp, atol=tol, rtol=0, msg=where)
            torch.testing.assert_close(ent, plain_ent, atol=tol, rtol=0, msg=where)
        assert sorted(result["fused_grads"]) == sorted(result["plain_grads"]), where
        _close_rel(result["fused_grads"], result["plain_grads"], grad_tol, where)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_compute_loss_ran_the_fused_head_on_the_last_stage(world2, name):
    packs = len(world2[name][0]["fused"])
    for result in world2[name]:
        trace, plain = result["trace"], result["plain_trace"]
        last = result["pp_rank"] == CASES[name][1] - 1
        assert trace.get("mcore:fused_loss", 0) == (packs if last else 0), (name, trace)
        # the CPU's chunked engine: each chunk's logits once for the statistics, once for its gradients
        assert trace.get("logprob:torch_chunk", 0) == (2 * packs if last else 0), (name, trace)
        assert not any(key.startswith("logprob:") or key == "mcore:fused_loss" for key in plain), (name, plain)


@pytest.mark.slow
def test_compute_loss_refusals(world2):
    for result in world2["refusals"]:
        assert "tensor parallelism tp=2" in result["tp2"] and "compute_logprobs(model, batches, loss_fn=" in result["tp2"]
        assert "context parallelism (cp=2)" in result["cp2"] and "loss_fn=" in result["cp2"]
        assert "critic" in result["critic"] and "value_head" in result["critic"]
        assert "batch 0: token_args[0] must be a tensor with one row per token (28)" in result["short"]
        assert "token_args has 2 entries for 3 batches" in result["count"]
        assert "one tuple of [T_real, ...] tensors per batch" in result["flat"]
        assert "token_args=(advantages,)" in result["single_bare"]
        assert "same number of token args" in result["arity"]
        assert "McoreModel" in result["not_a_model"]
        assert "at least one packed batch" in result["empty"]
        single = result["single"]  # one batch, no token args: one LossOutput, its loss the scored tokens' -log p
        assert single.loss.shape == () and single.logprob.shape == single.entropy.shape == (3,)
        torch.testing.assert_close(single.loss, -single.logprob.sum(), atol=TOL["mcore_vs_hf_fp32"], rtol=0)
