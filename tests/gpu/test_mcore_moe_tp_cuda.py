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
from support.mcore_moe_tp_cuda import on_cpu


pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

# The cases and checks are the gloo test's (spawned ranks inherit this path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "dist"))


def _cases_worker(rank: int, world_size: int, cases: list) -> dict:
    from support.mcore_moe_tp import moe_tp_case, case_name

    return {case_name(case): on_cpu(moe_tp_case(*case)) for case in cases}


def test_moe_tp2_ep2_training_on_nccl():
    pytest.importorskip("megatron.core")
    from support.mcore_moe_tp import WORLD, check_results, saved_cases
    from support.mcore_nccl import run_nccl

    with tempfile.TemporaryDirectory() as root:
        results = run_nccl(_cases_worker, WORLD, (saved_cases(root),))
    check_results(results, TOL["mcore_cuda_vs_hf_fp32"], TOL["grad_mcore_cuda_vs_hf_fp32_rel"])


def _overlap_worker(rank: int, world_size: int, directory: str) -> dict:
    from support.mcore_glm4_moe import schedules_plain_and_overlapped

    return on_cpu(schedules_plain_and_overlapped(directory))


def test_ep_overlap_schedule_on_nccl():
    """GLM-4.5 in bf16 at TP=2 x EP=2 under Megatron's combined 1F1B schedule (``overlap_moe_expert_parallel_comm``),
    where its all-to-alls really run on a second CUDA stream: per-token log-probs and entropy as the plain
    schedule's and transformers' fp32 forward (bf16 rounding), gradients as the plain schedule's (relative L2 norm:
    CUDA kernels may accumulate in another order)."""
    pytest.importorskip("megatron.core")
    from support.mcore_cp import cp_reference, cp_tiny_hf
    from support.mcore_nccl import run_nccl

    with tempfile.TemporaryDirectory() as root:
        hf = cp_tiny_hf("glm4_moe", {})
        hf.save_pretrained(root)
        results = run_nccl(_overlap_worker, 2, (root,))
        ref_out, _ = cp_reference(hf)
    tol, grad_tol = TOL["mcore_bf16_cuda_vs_hf_fp32"], TOL["grad_bf16_vs_fp32_rel_norm"]
    for rank, result in enumerate(results):
        plain, overlapped = result["plain"], result["overlapped"]
        assert (plain["plans"], overlapped["plans"]) == (0, len(ref_out)), rank
        for (lp, ent), (plain_lp, plain_ent), (ref_lp, ref_ent) in zip(overlapped["out"], plain["out"], ref_out):
            for got, want in ((lp, plain_lp), (ent, plain_ent), (lp, ref_lp), (ent, ref_ent)):
                torch.testing.assert_close(got, want, atol=tol, rtol=0, msg=f"rank {rank}")
        assert sorted(overlapped["grads"]) == sorted(plain["grads"])
        for name, grad in plain["grads"].items():
            diff = (overlapped["grads"][name].float() - grad.float()).norm()
            assert diff <= grad_tol * grad.float().norm() + 1e-6, (rank, name, float(diff))
