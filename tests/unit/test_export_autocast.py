"""The export gives the same bytes inside and outside a caller's ``torch.autocast`` region: merged LoRA weights,
blockwise FP8 (weights and scales) and its dequantization. CUDA: tests/gpu/test_export_autocast_cuda.py."""

import pytest
import torch

from actorcore.export import dequantize_fp8_blockwise, hf_weight_stream, iter_tensors, quantize_fp8_blockwise
from actorcore.testing.tiny_configs import build_tiny_model


def _lora_model():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                             lora_dropout=0.0)
    model = peft.get_peft_model(build_tiny_model("llama", seed=2), config)
    with torch.no_grad():  # lora_B starts at zero, which would make the merge a copy
        for k, (name, p) in enumerate(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)) * 0.3)
    return model


def _bytes(tensor):
    return tensor.contiguous().view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)


def _assert_same_bytes(outside, inside):
    assert list(outside) == list(inside)
    for name, tensor in outside.items():
        assert inside[name].dtype == tensor.dtype and torch.equal(_bytes(inside[name]), _bytes(tensor)), name


@pytest.mark.parametrize("quantize", [None, "fp8_blockwise"])
def test_merged_lora_and_fp8_export_are_the_same_bytes_under_autocast(quantize):
    model = _lora_model()
    outside = dict(iter_tensors(hf_weight_stream(model, quantize=quantize)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = dict(iter_tensors(hf_weight_stream(model, quantize=quantize)))
    _assert_same_bytes(outside, inside)


def test_fp8_of_a_plain_model_and_its_dequantization_under_autocast():
    model = build_tiny_model("qwen3_moe", seed=4)
    outside = dict(iter_tensors(hf_weight_stream(model, quantize="fp8_blockwise")))
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_blockwise(weight)
    plain = dequantize_fp8_blockwise(q, s)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = dict(iter_tensors(hf_weight_stream(model, quantize="fp8_blockwise")))
        q2, s2 = quantize_fp8_blockwise(weight)
        again = dequantize_fp8_blockwise(q2, s2)
    _assert_same_bytes(outside, inside)
    assert torch.equal(_bytes(q2), _bytes(q)) and torch.equal(s2, s)
    assert again.dtype == torch.float32 and torch.equal(again, plain)
