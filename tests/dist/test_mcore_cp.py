"""Context parallelism on the Megatron route (gloo, 4 CPU ranks, one spawned group): per-token log-probs, entropy
and every parameter's gradient equal plain transformers' fp32 forward, at TP=2 x CP=2 (mistral: a sliding window
shorter than the sequences, GQA), CP=4 (qwen2: q/k/v biases) and PP=2 x CP=2 (llama). Sequences of 1 and 2
tokens are shorter than 2*CP and get padded. Gradients are averaged over the data x context parallel group
first, as Megatron's DDP does (the schedule scales each rank's loss by cp)."""

from __future__ import annotations

import collections
import tempfile

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL

pytest.importorskip("megatron.core")

LENGTHS = [(5, 11, 3, 9), (14, 2, 7), (1, 6, 12)]
# (model_type, overrides, tp, pp, cp): 4 ranks each.
LAYOUTS = [("mistral", {}, 2, 1, 2), ("qwen2", {}, 1, 1, 4), ("llama", {"tie_word_embeddings": False}, 1, 2, 2)]


def _sequences() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [[torch.randint(3, 131, (n,), generator=gen) for n in lengths] for lengths in LENGTHS]


def _tiny_hf(model_type: str, overrides: dict):
    from actorcore.testing.tiny_configs import build_tiny_model

    return build_tiny_model(model_type, seed=5, **overrides)


def _megatron_grads_as_hf(chunks, context) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, HF-named and gathered over TP / PP (the export's converters are linear)."""
    from actorcore.mcore.checkpoint import gather_hf_state_dict

    params = [p for chunk in chunks for p in chunk.parameters()]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return gather_hf_state_dict(chunks, context)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _layout(model_type: str, tp: int, pp: int, cp: int, directory: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    import actorcore as ac
    from actorcore.mcore.checkpoint import load_hf_into_mcore
    from actorcore.mcore.forward import compute_logprobs
    from actorcore.mcore.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    parallel = McoreParallel(tp=tp, pp=pp, cp=cp)
    context = initialize_megatron(parallel)
    assert (context.tp_size, context.pp_size, context.cp_size) == (tp, pp, cp)
    chunks = build_gpt_model(AutoConfig.from_pretrained(directory), parallel)
    load_hf_into_mcore(chunks, directory, context)
    trace: collections.Counter = collections.Counter()
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            layer.self_attention.core_attention.trace = trace
    batches = [ac.pack(s) for s in _sequences()]
    got = compute_logprobs(chunks, batches, context)
    fb = compute_logprobs(chunks, batches, context, loss_fn=lambda out, batch: -out.log_probs.sum())
    group = ps.get_data_parallel_group(with_context_parallel=True)
    for chunk in chunks:
        for param in chunk.parameters():
            dist.all_reduce(param.grad, group=group)
            param.grad /= dist.get_world_size(group)
    grads = _megatron_grads_as_hf(chunks, context)
    ps.destroy_model_parallel()
    return {"got": [(o.log_probs, o.entropy) for o in got], "fb": [o.log_probs for o in fb], "grads": grads,
            "trace": dict(trace)}


def _worker(rank: int, world_size: int, directories: list[str]) -> list[dict]:
    from actorcore.mcore.cpu_runtime import CpuRuntime

    with CpuRuntime():
        return [_layout(model_type, tp, pp, cp, directory)
                for (model_type, _, tp, pp, cp), directory in zip(LAYOUTS, directories)]


def _reference(hf) -> tuple[list, dict[str, torch.Tensor]]:
    """Per-batch ``[T]`` log-probs / entropy and the gradients of ``mean over batches of -sum(log-probs)``."""
    from actorcore.testing.reference import reference_logprobs, right_padded

    hf.zero_grad()
    outputs = []
    for sequences in _sequences():
        lp, ent = reference_logprobs(hf, *right_padded(sequences))
        (lp.sum() * (-1.0 / len(LENGTHS))).backward()
        outputs.append((lp.detach(), ent.detach()))
    return outputs, {name: p.grad.clone() for name, p in hf.named_parameters()}


@pytest.mark.slow
def test_context_parallel_equals_transformers():
    with tempfile.TemporaryDirectory() as root:
        directories, references = [], []
        for i, (model_type, overrides, *_sizes) in enumerate(LAYOUTS):
            hf = _tiny_hf(model_type, overrides)
            hf.save_pretrained(f"{root}/{i}")
            directories.append(f"{root}/{i}")
            references.append(_reference(hf))
        results = run_distributed(_worker, 4, args=(directories,))
    tol, grad_tol = TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"]
    for rank, per_layout in enumerate(results):
        for (model_type, _, tp, pp, cp), result, (ref_out, ref_grads) in zip(LAYOUTS, per_layout, references):
            where = f"rank {rank} {model_type} tp={tp} pp={pp} cp={cp}"
            # Every attention call took the context-parallel path (2 layers over the pipeline stages, 3 batches,
            # forward-only and forward-backward).
            assert result["trace"] == {"varlen_attention:at_positions": 2 // pp * 3 * 2}, where
            for (lp, ent), fb, (ref_lp, ref_ent) in zip(result["got"], result["fb"], ref_out):
                assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape, where
                torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0, msg=where)
                torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0, msg=where)
                torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0, msg=where)
            assert sorted(result["grads"]) == sorted(ref_grads), where
            for name, ref_grad in ref_grads.items():
                scale = ref_grad.abs().max()
                assert scale > 0, (where, name)
                torch.testing.assert_close(result["grads"][name], ref_grad, atol=grad_tol * scale, rtol=0,
                                           msg=f"{where} {name}")
