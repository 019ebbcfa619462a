"""MoE at tensor parallelism on the Megatron route: the cases run on each rank, their saved results and the checks
against transformers (gradients mapped back to HF names)."""

from __future__ import annotations

import torch


# (model_type, ep, build overrides) at TP=2 on two ranks: EP=2 shares the TP ranks, EP=1 replicates the experts.
# gpt-oss: its sinks split over TP with the heads, biases on every linear (router and experts included).
CASES = (("qwen3_moe", 2, {}), ("qwen3_moe", 1, {}), ("deepseek_v3", 2, {}), ("deepseek_v3", 1, {}),
         ("qwen3", 1, {"sequence_parallel": True}), ("gpt_oss", 2, {}))


WORLD = 2


TP = 2


def case_name(case: tuple) -> str:
    """A case's key in the results: its model type and expert-parallel size."""
    return f"{case[0]} ep{case[1]}"


def grads_as_hf(model) -> dict[str, torch.Tensor]:
    """Every parameter's (finalized) gradient, HF-named and gathered like the weights themselves (experts
    stacked, as transformers 5 holds them in memory)."""
    import dataclasses

    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict

    if model.config.num_moe_experts:
        model = dataclasses.replace(model, expert_layout="grouped")
    saved = []
    for chunk in model.chunks:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            saved.append((param, param.data))
            param.data = torch.zeros_like(param) if grad is None else grad.detach().to(param.dtype)
    try:
        return gather_hf_state_dict(model)
    finally:
        for param, data in saved:
            param.data = data


def moe_tp_case(model_type: str, ep: int, overrides: dict, directory: str) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from support.mcore_logprobs import LENGTHS, logprob_batches, logprob_sequences, tiny_hf, reference_logprobs_packed

    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    hf = tiny_hf(model_type)
    parallel = McoreParallel(tp=TP, ep=ep)
    initialize_megatron(parallel)
    model = build_gpt_model(hf.config, parallel, **overrides)
    load_hf_into_mcore(model, directory)
    # The trainer's wrapper: gradients accumulate into its buffers; finalize_model_grads reduces them.
    wrapped = [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk) for chunk in model.chunks]
    seen_tokens = []
    hook = model.chunks[0].decoder.final_layernorm.register_forward_hook(
        lambda module, args, out: seen_tokens.append(args[0].shape[0]))
    batches = logprob_batches()

    got = compute_logprobs(model, batches)
    fb = compute_logprobs(model, batches, loss_fn=lambda out, batch: -out.log_probs.sum())
    finalize_model_grads(wrapped)
    hook.remove()
    grads = grads_as_hf(model)

    with torch.no_grad():
        ref = [reference_logprobs_packed(hf, sequences) for sequences in logprob_sequences()]
    hf.zero_grad()
    for sequences in logprob_sequences():
        (reference_logprobs_packed(hf, sequences)[0].sum() * (-1.0 / len(LENGTHS))).backward()
    ref_grads = {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}
    padded = [-(-b.num_tokens // TP) * TP for b in batches]
    result = {"got": [(o.log_probs, o.entropy) for o in got], "fb": [o.log_probs for o in fb], "ref": ref,
              "grads": grads, "ref_grads": ref_grads, "sp": model.config.sequence_parallel,
              "mla_full_width": model.mla_full_width_projections,
              "seen_tokens": seen_tokens, "sp_tokens": [n // TP for n in padded] * 2}
    ps.destroy_model_parallel()
    return result


def saved_cases(root: str) -> list[tuple]:
    """``CASES`` with the directory each tiny HF model was saved to."""
    from support.mcore_logprobs import tiny_hf

    for model_type in {model_type for model_type, _, _ in CASES}:
        tiny_hf(model_type).save_pretrained(f"{root}/{model_type}")
    return [(model_type, ep, overrides, f"{root}/{model_type}") for model_type, ep, overrides in CASES]


def check_results(results: list[dict], tol: float, grad_tol_rel: float) -> None:
    for rank, by_case in enumerate(results):
        assert sorted(by_case) == sorted(case_name(case) for case in CASES)
        for name, result in by_case.items():
            model_type, where = name.split()[0], f"rank {rank} {name}"
            assert result["sp"], where
            assert result["seen_tokens"] == result["sp_tokens"], where
            assert result["mla_full_width"] == (2 if model_type == "deepseek_v3" else 0), where
            assert_matches_transformers(result, tol, grad_tol_rel, where)


def assert_matches_transformers(result: dict, tol: float, grad_tol_rel: float, where: str) -> None:
    """A case's log-probs and entropy (forward only and forward-backward) per token, and every gradient per element
    relative to its max magnitude, against transformers' (``ref``, ``ref_grads``)."""
    for (lp, ent), (ref_lp, ref_ent), fb in zip(result["got"], result["ref"], result["fb"]):
        torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0, msg=where)
        torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0, msg=where)
        torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0, msg=where)
    grads, ref_grads = result["grads"], result["ref_grads"]
    assert set(ref_grads) <= set(grads), (where, sorted(set(ref_grads) - set(grads)))
    for name, ref_grad in ref_grads.items():
        scale = ref_grad.abs().max()
        torch.testing.assert_close(grads[name], ref_grad, atol=grad_tol_rel * scale, rtol=0, msg=f"{where} {name}")
