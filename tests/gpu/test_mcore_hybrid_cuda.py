"""Hybrid Gated DeltaNet models (Qwen3.5, Qwen3-Next) on the Megatron route on GPUs with NCCL (2 GPUs), fp32: at
TP=2 (Qwen3-Next: MoE, so with sequence parallelism) and PP=2 the HF checkpoint loads and exports back bit-exact, and
a packed batch's per-token log-probs and entropy, forward and through forward-backward, equal plain transformers'
fp32 forward (on the CPU, its torch fallback of the conv and the delta rule); the DeltaNet layers count the kernels
they ran (flash-linear-attention's where installed and allowed, else the torch reference). Skipped without two CUDA
devices or megatron-core."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from actorcore.testing.tolerances import TOL

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

# The tiny models and sequences are the gloo test's (spawned ranks inherit this path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "dist"))
from support.mcore_hybrid import hybrid_reference, hybrid_sequences, tiny_hf  # noqa: E402


def _worker(rank: int, world_size: int, model_type: str, tp: int, pp: int, hf_dir: str) -> dict:
    from collections import Counter

    import actorcore as ac
    from actorcore.batch import pad_to_multiple
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import checkpoint_expert_layout, load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict
    from megatron.core import parallel_state
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    parallel = McoreParallel(tp=tp, pp=pp)
    initialize_megatron(parallel)
    model = build_gpt_model(config, parallel, expert_layout=checkpoint_expert_layout(hf_dir, config))
    assert next(model.chunks[0].parameters()).is_cuda
    load_hf_into_mcore(model, hf_dir)
    exported = {k: v.cpu() for k, v in gather_hf_state_dict(model).items()}
    layers = [m for c in model.chunks for m in c.modules() if type(m).__name__ == "PackedGatedDeltaNet"]
    for layer in layers:
        layer.trace = Counter()
    batches = [ac.pack(s) for s in hybrid_sequences()]
    batches = [pad_to_multiple(b, 32) if pp > 1 and b.num_tokens % 32 else b for b in batches]
    got = compute_logprobs(model, batches)
    fb = compute_logprobs(model, batches, loss_fn=lambda out, batch: -out.log_probs.sum())
    parallel_state.destroy_model_parallel()
    return {"exported": exported, "got": [(o.log_probs.cpu(), o.entropy.cpu()) for o in got],
            "fb": [o.log_probs.cpu() for o in fb], "traces": [dict(layer.trace) for layer in layers]}


@pytest.mark.parametrize("model_type,tp,pp", [("qwen3_5_text", 2, 1), ("qwen3_5_text", 1, 2), ("qwen3_next", 2, 1)])
def test_hybrid_megatron_on_nccl(tmp_path, model_type, tp, pp):
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file
    from support.mcore_nccl import run_nccl

    hf = tiny_hf(model_type)
    hf_dir = str(tmp_path / "hf")
    hf.save_pretrained(hf_dir)
    results = run_nccl(_worker, tp * pp, (model_type, tp, pp, hf_dir))
    source = load_file(os.path.join(hf_dir, "model.safetensors"))
    with torch.no_grad():
        refs = [hybrid_reference(hf, s) for s in hybrid_sequences()]
    tol = TOL["mcore_cuda_vs_hf_fp32"]
    for rank, r in enumerate(results):
        assert sorted(r["exported"]) == sorted(source), rank
        for name, tensor in source.items():
            assert r["exported"][name].dtype == tensor.dtype and torch.equal(r["exported"][name], tensor), (rank, name)
        for (lp, ent), fb, (ref_lp, ref_ent) in zip(r["got"], r["fb"], refs):
            torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0, msg=f"rank {rank} log-probs")
            torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0, msg=f"rank {rank} entropy")
            torch.testing.assert_close(fb, ref_lp, atol=tol, rtol=0, msg=f"rank {rank} forward-backward")
        for trace in r["traces"]:
            assert sum(v for k, v in trace.items() if k.startswith("causal_conv1d:")) > 0, trace
            assert sum(v for k, v in trace.items() if k.startswith("gated_delta_rule:")) > 0, trace
