"""MoE training at TP=2 x EP=2 with sequence parallelism on 2 GPUs (NCCL): the gloo test's cases
(tests/dist/test_mcore_moe_tp.py: Qwen3-MoE, DeepSeek-V3, dense Qwen3 with SP) on CUDA, where every
collective of the SP path (embedding scatter, all-gather / reduce-scatter around the layers, the head's
all-gather, MLA's full-width kv projection, finalize_model_grads) runs on NCCL. Per-token log-probs and
every parameter's gradient equal transformers' fp32 forward on the CPU. Skipped without two CUDA devices."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

from actorcore.testing.tolerances import TOL

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

# The cases and checks are the gloo test's (spawned ranks inherit this path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "dist"))


def _on_cpu(value):
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _cases_worker(rank: int, world_size: int, cases: list) -> dict:
    from test_mcore_moe_tp import _case, case_name

    return {case_name(case): _on_cpu(_case(*case)) for case in cases}


def test_moe_tp2_ep2_training_on_nccl():
    pytest.importorskip("megatron.core")
    from test_mcore_moe_tp import WORLD, check_results, saved_cases
    from test_mcore_nccl import _run_nccl

    with tempfile.TemporaryDirectory() as root:
        results = _run_nccl(_cases_worker, WORLD, (saved_cases(root),))
    check_results(results, TOL["mcore_cuda_vs_hf_fp32"], TOL["grad_mcore_cuda_vs_hf_fp32_rel"])
