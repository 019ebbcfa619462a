"""The MoE experts path with quack's fused GEMMs (``kernels.moe_quack``): what runs without a GPU. Its numerics are
tested on the H200 (``tests/gpu/test_moe_quack_cuda.py``); here, reading the DSL version quack pins and the
refusal without a Hopper GPU."""

from __future__ import annotations

import pytest
import torch

from actorcore.kernels.quack_runtime import _dsl_requirement, quack_refusal


@pytest.mark.parametrize("requires,want", [
    (["nvidia-cutlass-dsl==4.6.2", "torch", 'nvidia-cutlass-dsl[cu13]==4.6.2; extra == "cu13"'], "==4.6.2"),
    (["torch", "nvidia-cutlass-dsl>=4.7", "apache-tvm-ffi<0.2,>=0.1.6"], ">=4.7"),
    (["nvidia-cutlass-dsl[cu13] ==4.6.2"], "==4.6.2"),
    (["torch", "nvidia-cutlass-dsl-libs-base==4.6.2"], None),
    (['nvidia-cutlass-dsl[cu13]==4.6.2; extra == "cu13"'], None),
])
def test_reads_the_dsl_requirement(requires, want):
    assert _dsl_requirement(requires) == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_refuses_without_a_hopper_gpu():
    assert "Hopper" in quack_refusal()
