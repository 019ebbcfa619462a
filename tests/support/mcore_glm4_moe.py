"""GLM-4-MoE on the Megatron route: the plain and the expert-parallel-overlapped schedules of one training step."""

from __future__ import annotations

import torch


def schedules_plain_and_overlapped(directory: str) -> dict:
    """The same bf16 model at TP=2 x EP=2, forward-backward under the plain schedule and, built with
    ``overlap_moe_expert_parallel_comm=True``, under Megatron's combined 1F1B schedule: outputs and raw gradients."""
    from megatron.core import parallel_state as ps
    from support.mcore_cp import cp_sequences
    from transformers import AutoConfig

    import actorcore as ac
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    parallel = McoreParallel(tp=2, ep=2)
    result = {}
    for name, overrides in (("plain", {}), ("overlapped", {"overlap_moe_expert_parallel_comm": True})):
        initialize_megatron(parallel)
        model = build_gpt_model(AutoConfig.from_pretrained(directory), parallel, dtype=torch.bfloat16, **overrides)
        load_hf_into_mcore(model, directory)
        chunk, plans = model.chunks[0], []
        build_plan = chunk.build_schedule_plan  # counts the schedule plans the combined schedule asked for
        chunk.build_schedule_plan = lambda *a, **k: (plans.append(1), build_plan(*a, **k))[1]
        out = compute_logprobs(model, [ac.pack(s) for s in cp_sequences()], loss_fn=lambda o, b: -o.log_probs.sum())
        result[name] = {"out": [(o.log_probs, o.entropy) for o in out], "plans": len(plans),
                        "grads": {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}}
        ps.destroy_model_parallel()
    return result
