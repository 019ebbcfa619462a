"""The Megatron route under context parallelism: a tiny model, its sequences, a layout case run on each rank, the
gradients reduced as Megatron's DDP does, and the transformers reference."""

from __future__ import annotations

import collections

import torch


LENGTHS = [(5, 11, 3, 9), (14, 2, 7), (1, 6, 12)]


def cp_sequences() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [[torch.randint(3, 131, (n,), generator=gen) for n in lengths] for lengths in LENGTHS]


def cp_tiny_hf(model_type: str, overrides: dict, task: str = "causal_lm"):
    from support.mcore_weights import randomize_constant_tensors

    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model(model_type, seed=5, task=task, **overrides)
    randomize_constant_tensors(model, seed=1)  # norms and DeepSeek's score-correction bias are not constant
    return model


def megatron_grads_as_hf(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, HF-named and gathered over TP / PP (the export's converters are linear)."""
    import dataclasses

    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict

    if model.config.num_moe_experts:  # transformers 5 holds experts stacked (experts.gate_up_proj): export that layout
        model = dataclasses.replace(model, expert_layout="grouped")
    params = [p for chunk in model.chunks for p in chunk.parameters()]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return gather_hf_state_dict(model)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def cp_layout(model_type: str, tp: int, pp: int, cp: int, ep: int, directory: str) -> dict:
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    parallel = McoreParallel(tp=tp, pp=pp, cp=cp, ep=ep)
    context = initialize_megatron(parallel)
    assert (context.tp_size, context.pp_size, context.cp_size, context.ep_size) == (tp, pp, cp, ep)
    model = build_gpt_model(AutoConfig.from_pretrained(directory), parallel)
    load_hf_into_mcore(model, directory)
    trace: collections.Counter = collections.Counter()
    for chunk in model.chunks:
        for layer in chunk.decoder.layers:
            layer.self_attention.core_attention.trace = trace
    result = run_and_reduce(model, trace)
    ps.destroy_model_parallel()
    return result


def run_and_reduce(model, trace) -> dict:
    """Forward-only and forward+backward log-probs of ``cp_sequences()``, then every parameter's gradient reduced as
    Megatron's DDP does (sum over the ranks holding a copy: data x context parallel, for experts the expert data
    parallel ranks; divided by the data x context parallel size), HF-named."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import actorcore as ac
    from actorcore.mcore.run.forward import compute_logprobs

    batches = [ac.pack(s) for s in cp_sequences()]
    got = compute_logprobs(model, batches)
    fb = compute_logprobs(model, batches, loss_fn=lambda out, batch: -out.log_probs.sum())
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    for chunk in model.chunks:
        for param in chunk.parameters():
            expert = not getattr(param, "allreduce", True)
            dist.all_reduce(param.grad, group=ps.get_expert_data_parallel_group() if expert else dp_cp)
            param.grad /= dist.get_world_size(dp_cp)
    return {"got": [(o.log_probs, o.entropy) for o in got], "fb": [o.log_probs for o in fb],
            "grads": megatron_grads_as_hf(model), "trace": dict(trace)}


def cp_reference(hf) -> tuple[list, dict[str, torch.Tensor]]:
    """Per-batch ``[T]`` log-probs / entropy and the gradients of ``mean over batches of -sum(log-probs)``."""
    from actorcore.testing.reference import reference_logprobs, right_padded

    hf.zero_grad()
    outputs = []
    for sequences in cp_sequences():
        lp, ent = reference_logprobs(hf, *right_padded(sequences))
        (lp.sum() * (-1.0 / len(LENGTHS))).backward()
        outputs.append((lp.detach(), ent.detach()))
    return outputs, {name: p.grad.clone() for name, p in hf.named_parameters() if p.grad is not None}
