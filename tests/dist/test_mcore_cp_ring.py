"""Context parallelism with the ring exchange (``cp_comm_type="p2p"``) on the Megatron route (gloo, 4 CPU ranks, one
spawned group): per-token log-probs, entropy and every parameter's gradient equal plain transformers' fp32 forward
and, per element, the all-gather path on the same weights, at TP=2 x CP=2 (mistral: a sliding window shorter than
the sequences, GQA), CP=4 (qwen2: q/k/v biases; at CP=4 some of a rank's query chunks see none of a block's
keys) and CP=2 x DP=2 (deepseek_v3: MLA, whose keys and values have different head dims, and MoE); at PP=2 x CP=2
(llama: the pipeline's sends and the ring's interleave) the ring against transformers only. The traces prove
which path ran."""

from __future__ import annotations

import collections
import tempfile

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL


pytest.importorskip("megatron.core")

# (model_type, overrides, tp, pp, cp): 4 ranks each.
LAYOUTS = [("mistral", {}, 2, 1, 2), ("qwen2", {}, 1, 1, 4), ("llama", {"tie_word_embeddings": False}, 1, 2, 2),
           ("deepseek_v3", {}, 1, 1, 2)]


def _run(model, comm: str) -> dict:
    """Log-probs / entropy, forward-backward log-probs and HF-named gradients averaged over data x CP ranks."""
    from support.mcore_cp import run_and_reduce

    trace: collections.Counter = collections.Counter()
    for chunk in model.chunks:
        chunk.zero_grad(set_to_none=True)
        for layer in chunk.decoder.layers:
            layer.self_attention.core_attention.trace = trace
            layer.self_attention.core_attention.cp_ring = comm == "p2p"  # same weights, the other path
    return run_and_reduce(model, trace)


def _layout(tp: int, pp: int, cp: int, directory: str) -> dict:
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    parallel = McoreParallel(tp=tp, pp=pp, cp=cp)
    initialize_megatron(parallel)
    model = build_gpt_model(AutoConfig.from_pretrained(directory), parallel, cp_comm_type="p2p")
    attention = model.chunks[0].decoder.layers[0].self_attention.core_attention
    assert model.config.cp_comm_type == "p2p" and attention.cp_ring  # the override selected the ring
    load_hf_into_mcore(model, directory)
    # The all-gather at PP=2 x CP=2 is checked against transformers in test_mcore_cp.py; here only the ring.
    results = {comm: _run(model, comm) for comm in (("p2p",) if pp > 1 else ("p2p", "all_gather"))}
    ps.destroy_model_parallel()
    return results


def _worker(rank: int, world_size: int, directories: list[str]) -> list[dict]:
    from actorcore.mcore.cpu_runtime import CpuRuntime

    with CpuRuntime():
        return [_layout(tp, pp, cp, directory) for (_, _, tp, pp, cp), directory in zip(LAYOUTS, directories)]


def test_ring_context_parallel_equals_transformers_and_the_all_gather():
    from support.mcore_cp import cp_reference, cp_tiny_hf

    with tempfile.TemporaryDirectory() as root:
        directories, references = [], []
        for i, (model_type, overrides, *_sizes) in enumerate(LAYOUTS):
            hf = cp_tiny_hf(model_type, overrides)
            assert model_type != "mistral" or hf.config.sliding_window < 14  # shorter than the longest sequence
            hf.save_pretrained(f"{root}/{i}")
            directories.append(f"{root}/{i}")
            references.append(cp_reference(hf))
        results = run_distributed(_worker, 4, args=(directories,))
    tol, grad_tol = TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"]
    ring_tol, ring_grad_tol = TOL["cp_ring_vs_all_gather_fp32"], TOL["grad_cp_ring_vs_all_gather_fp32_rel"]
    for rank, per_layout in enumerate(results):
        for (model_type, _, tp, pp, cp), result, (ref_out, ref_grads) in zip(LAYOUTS, per_layout, references):
            where = f"rank {rank} {model_type} tp={tp} pp={pp} cp={cp}"
            ring, gathered = result["p2p"], result.get("all_gather")
            assert (gathered is None) == (pp > 1), where
            # 2 layers over the pipeline stages, 3 batches, forward-only and forward-backward: every call took its path.
            calls = 2 // pp * 3 * 2
            assert ring["trace"] == {"varlen_attention:cp_ring": calls}, where
            for i, ((lp, ent), fb, (ref_lp, ref_ent)) in enumerate(zip(ring["got"], ring["fb"], ref_out)):
                assert lp.dtype == torch.float32 and lp.shape == ref_lp.shape, where
                torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0, msg=where)
                torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0, msg=where)
                torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0, msg=where)
                if gathered is not None:
                    ag_lp, ag_ent = gathered["got"][i]
                    torch.testing.assert_close(lp, ag_lp, atol=ring_tol, rtol=0, msg=f"{where} vs all-gather")
                    torch.testing.assert_close(ent, ag_ent, atol=ring_tol, rtol=0, msg=f"{where} vs all-gather")
            if gathered is not None:
                assert gathered["trace"] == {"varlen_attention:at_positions": calls}, where
            assert set(ref_grads) <= set(ring["grads"]), where
            for name, ref_grad in ref_grads.items():
                scale = ref_grad.abs().max()
                torch.testing.assert_close(ring["grads"][name], ref_grad, atol=grad_tol * scale, rtol=0,
                                           msg=f"{where} {name}")
                if gathered is not None:
                    torch.testing.assert_close(ring["grads"][name], gathered["grads"][name],
                                               atol=ring_grad_tol * scale, rtol=0, msg=f"{where} {name} vs all-gather")
