"""The export gives the same bytes inside and outside ``torch.autocast("cuda", torch.bfloat16)``: merged LoRA
weights and blockwise FP8 (the CPU flavour: tests/unit/test_export_autocast.py)."""

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantize", [None, "fp8_blockwise"])
def test_export_is_the_same_bytes_under_cuda_autocast(quantize):
    peft = pytest.importorskip("peft")
    from actorcore.export import hf_weight_stream, iter_tensors
    from actorcore.testing.tiny_configs import build_tiny_model

    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "down_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(build_tiny_model("llama", seed=2), config).cuda()
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)).cuda() * 0.3)
    outside = dict(iter_tensors(hf_weight_stream(model, quantize=quantize)))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        inside = dict(iter_tensors(hf_weight_stream(model, quantize=quantize)))
    assert list(outside) == list(inside)
    for name, tensor in outside.items():
        assert inside[name].dtype == tensor.dtype
        assert torch.equal(inside[name].view(torch.uint8), tensor.view(torch.uint8)), name
