"""Training at TP=2 with sequence parallelism on the Megatron route (gloo, 2 ranks = TP=2 x EP=2, one group).

Qwen3-MoE (q/k norms, a dense layer, routed experts) and DeepSeek-V3 (MLA, sigmoid grouped routing with a
score-correction bias, a shared expert) at TP=2 x EP=2 and at TP=2 x EP=1 (sequence parallelism by default for
MoE at TP > 1; at EP=1 every rank holds all experts and routes only its own tokens, so the expert gradients
are reduced over Megatron's expert data parallel group: ``mcore/build/expert_grads.py``), gpt-oss (attention sinks split
over TP with the heads, biases on every linear) at TP=2 x EP=2, and dense Qwen3 at TP=2 with sequence parallelism
asked for: per-token log-probs and entropy
equal plain transformers' fp32 forward, and every parameter's gradient, after Megatron's own
``finalize_model_grads`` (its DDP wrapper around the chunks; it sums the ``sequence_parallel`` norm and
router gradients over TP), equals transformers' gradient of the same loss mapped to HF names by the
export (which is what TP=1 reproduces). Each case also proves that sequence parallelism ran (the final
norm saw ``T / tp`` tokens), and DeepSeek-V3 that its kv down projections took the full-width route.
"""

from __future__ import annotations

import tempfile

import pytest

from actorcore.testing.distributed import run_distributed
from actorcore.testing.tolerances import TOL
from support.mcore_moe_tp import WORLD, moe_tp_case, case_name, check_results, saved_cases


pytest.importorskip("megatron.core")

def _worker(rank: int, world_size: int, cases: list[tuple]) -> dict:
    from actorcore.mcore.cpu_runtime import CpuRuntime

    with CpuRuntime():
        return {case_name(case): moe_tp_case(*case) for case in cases}


@pytest.mark.slow
def test_tp2_sequence_parallel_training_matches_transformers():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_worker, WORLD, args=(saved_cases(root),))
    check_results(results, TOL["mcore_vs_hf_fp32"], TOL["grad_mcore_vs_hf_fp32_rel"])
