"""MXFP4 (gpt-oss's expert format): actorcore's quantiser gives the bytes of a plain quantiser written from the OCP
spec, its dequantiser the values of transformers' own, and re-quantising a dequantised weight gives its bytes back."""

from __future__ import annotations

import pytest
import torch

from actorcore.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from support.mxfp4_reference import reference_quantize_mxfp4


def _weights() -> torch.Tensor:
    """Random bf16 weights [2, 3, 64] whose blocks hold the awkward cases: exact ties between E2M1 values, values
    past the block scale's 6x, negative zeros and an all-zero block."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2, 3, 64, generator=gen) * torch.logspace(-3, 1, 3).view(1, 3, 1)
    w[0, 0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])  # ties at the block scale 1
    w[0, 0, 8] = 7.5  # beyond 6x the scale: saturates
    w[0, 1, :32] = 0.0
    w[0, 1, 3] = -0.0
    w[1, 2, 32] = -1e-3 * w[1, 2, 33:64].abs().max()  # rounds to a negative zero
    return w.to(torch.bfloat16)


def test_quantize_matches_the_spec_reference():
    w = _weights()
    blocks, scales = quantize_mxfp4(w)
    ref_blocks, ref_scales = reference_quantize_mxfp4(w)
    assert blocks.shape == (2, 3, 2, 16) and scales.shape == (2, 3, 2)
    assert torch.equal(blocks, ref_blocks) and torch.equal(scales, ref_scales)


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = reference_quantize_mxfp4(_weights())
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    # transformers returns the fused-experts layout [E, cols, rows] (the model's [E, in, out]).
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(ours.transpose(-1, -2), theirs)
    assert torch.equal(ours.view(torch.int16), theirs.transpose(-1, -2).view(torch.int16))  # signed zeros too
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), ours.float())


def test_requantizing_a_dequantized_weight_is_idempotent():
    blocks, scales = reference_quantize_mxfp4(_weights())
    again = quantize_mxfp4(dequantize_mxfp4(blocks, scales))
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)
    assert bool((blocks >> 4 == 8).any() | ((blocks & 15) == 8).any())  # a negative zero took part


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_mxfp4(torch.zeros(3, 40))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(torch.zeros(3, 2, 16, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8))


def test_export_stream_and_config():
    """The export re-quantises only the named fused-expert weights ([E, in, out] -> blocks along ``in``), and a bf16
    export of a model from an MXFP4 checkpoint drops the checkpoint's quantization_config."""
    from actorcore.export.mxfp4 import quantize_stream_mxfp4, with_mxfp4_config, without_quantization_config
    from actorcore.testing.tiny_configs import tiny_config

    weight = _weights().transpose(-1, -2)  # the model's [E, in, out]
    bias = torch.ones(3)
    (bucket,) = list(quantize_stream_mxfp4([[("m.experts.gate_up_proj", weight), ("m.bias", bias)]],
                                           ("experts.gate_up_proj",)))
    names = [name for name, _ in bucket]
    assert names == ["m.experts.gate_up_proj_blocks", "m.experts.gate_up_proj_scales", "m.bias"]
    ref_blocks, ref_scales = reference_quantize_mxfp4(weight.transpose(-1, -2))
    assert torch.equal(bucket[0][1], ref_blocks) and torch.equal(bucket[1][1], ref_scales)
    with pytest.raises(ValueError, match="no MXFP4 weights"):
        quantize_stream_mxfp4([], ())
    config = with_mxfp4_config(tiny_config("gpt_oss"))
    assert config.to_dict()["quantization_config"]["quant_method"] == "mxfp4"
    assert "quantization_config" not in without_quantization_config(config).to_dict()
    assert "quantization_config" in config.to_dict()  # copies, never the caller's config


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_weight_is_refused(bad):
    """inf / NaN have no MXFP4 code: quantised, their block would come back as other numbers."""
    from actorcore.kernels.mxfp4 import quantize_mxfp4

    weight = torch.randn(4, 64)
    weight[2, 40] = bad
    with pytest.raises(ValueError, match="non-finite weight"):
        quantize_mxfp4(weight)
