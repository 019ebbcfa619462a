"""CUDA: blockwise FP8 export computed on the GPU gives the same bytes as on the CPU (the quantization is exact
elementwise IEEE arithmetic: amax, one division per element, round to e4m3), at a Qwen3-8B layer's shapes, and for
a whole model's stream, plus a LoRA model merged on the GPU against PEFT's own merge there.

Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from actorcore.export import dequantize_fp8_blockwise, hf_weight_stream, iter_tensors, quantize_fp8_blockwise
from actorcore.testing.tiny_configs import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("shape, dtype", [((4096, 4096), torch.bfloat16), ((12288, 4096), torch.bfloat16),
                                          ((3, 1000, 777), torch.float32)])
def test_cuda_quantization_is_the_cpu_bytes(shape, dtype):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    w[..., :128, :128] = 0  # an all-zero block
    q_cpu, s_cpu = quantize_fp8_blockwise(w)
    q_gpu, s_gpu = quantize_fp8_blockwise(w.cuda())
    assert q_gpu.is_cuda and torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(dequantize_fp8_blockwise(q_gpu, s_gpu).cpu(), dequantize_fp8_blockwise(q_cpu, s_cpu))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama"])
def test_cuda_stream_is_the_cpu_stream(model_type):
    model = build_tiny_model(model_type)
    want = dict(iter_tensors(hf_weight_stream(model, quantize="fp8_blockwise", dtype=torch.bfloat16)))
    got = dict(iter_tensors(hf_weight_stream(model.cuda(), quantize="fp8_blockwise", dtype=torch.bfloat16)))
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].is_cuda and got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].cpu().view(torch.uint8), tensor.view(torch.uint8)), name


def test_cuda_lora_merge_equals_peft_on_cuda():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_tiny_model("llama", seed=2).cuda(),
                                peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    got = dict(iter_tensors(hf_weight_stream(model, names="model")))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].is_cuda and torch.equal(got[name], tensor), name
