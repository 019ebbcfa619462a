"""Blockwise FP8 export: quantization bitwise equal to a plain-torch per-block reference, the round-trip error
bound per element and per block, the stream's names / dtypes / shapes against transformers' FP8 loader (which
modules it converts, and a from_pretrained of the exported directory). FSDP2: tests/dist/test_export_fp8_lora_fsdp."""

import math

import pytest
import torch

from actorcore.export import (BlockwiseFP8, dequantize_fp8_blockwise, hf_weight_stream, iter_tensors,
                              quantize_fp8_blockwise, save_sharded_safetensors)
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL


def _reference_quantize(w, block=(128, 128)):
    """Plain torch, one block at a time: scale_inv = amax / 448 (1 for an all-zero block), fp8 = w / scale_inv."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            amax = blk.abs().max()
            scale_inv = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            s[i, j] = scale_inv
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                (blk / scale_inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, s


def _weights():
    g = torch.Generator().manual_seed(0)
    edge = torch.randn(300, 200, generator=g) * torch.logspace(-6, 2, 200)  # edges of 44 rows / 72 columns
    edge[128:256, 0:128] = 0.0  # an all-zero block
    edge[5, 7] = 1e-30  # a value that becomes an e4m3 subnormal or zero next to large ones
    exact = torch.randn(256, 384, generator=g)
    experts = torch.randn(3, 130, 129, generator=g).bfloat16()  # leading dim: experts, bf16 input
    return {"edge": edge, "exact": exact, "experts": experts, "tiny": torch.randn(5, 3, generator=g)}


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_quantize_is_bitwise_the_plain_reference_and_within_the_bound(block):
    for label, w in _weights().items():
        q, s = quantize_fp8_blockwise(w, block)
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape, label
        assert s.dtype == torch.float32
        assert s.shape == (*w.shape[:-2], math.ceil(w.shape[-2] / block[0]), math.ceil(w.shape[-1] / block[1]))
        flat_w, flat_q = w.reshape(-1, *w.shape[-2:]), q.reshape(-1, *q.shape[-2:])
        flat_s = s.reshape(-1, *s.shape[-2:])
        for k in range(flat_w.shape[0]):
            ref_q, ref_s = _reference_quantize(flat_w[k], block)
            assert torch.equal(flat_q[k].view(torch.uint8), ref_q.view(torch.uint8)), (label, k)
            assert torch.equal(flat_s[k], ref_s), (label, k)
            # dequantized = fp8 * scale_inv per block, per element
            deq = dequantize_fp8_blockwise(flat_q[k], flat_s[k], block_size=block)
            scale = ref_s.repeat_interleave(block[0], 0)[: w.shape[-2]].repeat_interleave(block[1], 1)[:, : w.shape[-1]]
            assert torch.equal(deq, ref_q.float() * scale), (label, k)
            err = (deq - flat_w[k].float()).abs()
            bound = (TOL["fp8_e4m3_round_rel"] * flat_w[k].float().abs()
                     + TOL["fp8_e4m3_subnormal_abs_per_scale"] * scale) * (1 + TOL["fp8_fp32_arith_slack_rel"])
            assert (err <= bound).all(), (label, k, (err - bound).max().item())
            for i in range(ref_s.shape[0]):  # per block: the worst error is within 2^-4 of the block's amax
                for j in range(ref_s.shape[1]):
                    rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
                    amax = flat_w[k][rows, cols].float().abs().max()
                    worst = err[rows, cols].max()
                    assert worst <= TOL["fp8_e4m3_round_rel"] * amax * (1 + TOL["fp8_fp32_arith_slack_rel"]), label
    q, s = quantize_fp8_blockwise(_weights()["edge"])
    assert s[1, 0] == 1.0 and not q[128:256, 0:128].float().any()  # the all-zero block
    assert q.float().abs().max() == 448.0  # each block's largest value lands on the e4m3 maximum


def test_quantize_refuses_what_it_cannot_represent():
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8_blockwise(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_fp8_blockwise(torch.ones(4))
    with pytest.raises(ValueError, match=r"scale_inv has shape \(1, 1\).*needs \(2, 1\)"):
        dequantize_fp8_blockwise(torch.zeros(130, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    with pytest.raises(ValueError, match="block_size"):
        BlockwiseFP8(block_size=(0, 128))
    model = build_tiny_model("llama")
    with pytest.raises(ValueError, match="quantize must be"):
        next(hf_weight_stream(model, quantize="fp4"))
    with pytest.raises(ValueError, match="names='checkpoint'"):
        next(hf_weight_stream(model, quantize="fp8_blockwise", names="model"))


def _transformers_fp8_modules(model):
    """The modules transformers' FP8 loader converts (its default skip list), on a meta copy of the model."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(model.config)
    FineGrainedFP8HfQuantizer(FineGrainedFP8Config(), pre_quantized=True)._process_model_before_weight_loading(target)
    return {p for p, m in target.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gemma2"])
def test_fp8_stream_has_the_fp8_checkpoint_layout(model_type):
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model = build_tiny_model(model_type)
    plain = revert_weight_conversion(model, remove_tied_weights_from_state_dict(dict(model.state_dict()), model))
    got = dict(iter_tensors(hf_weight_stream(model, quantize="fp8_blockwise", dtype=torch.bfloat16,
                                             bucket_bytes=20_000)))
    scaled = {n.removesuffix("_scale_inv") for n in got if n.endswith("_scale_inv")}
    assert sorted(set(got) - {n + "_scale_inv" for n in scaled}) == sorted(plain)
    # the modules holding FP8 weights are the ones transformers' FP8 loader converts (per-expert names: their
    # fused experts module), and none of embeddings, lm_head, norms, router gates
    modules = {n.removesuffix(".weight") for n in scaled}
    modules = {m.split(".experts.")[0] + ".experts" if ".experts." in m else m for m in modules}
    assert modules == _transformers_fp8_modules(model)
    assert not [n for n in scaled if any(k in n for k in ("embed", "lm_head", "norm", "mlp.gate."))]
    for name, tensor in plain.items():
        if name in scaled:
            assert got[name].dtype == torch.float8_e4m3fn and got[name].shape == tensor.shape, name
            assert got[name + "_scale_inv"].dtype == torch.float32
            blocks = (math.ceil(tensor.shape[0] / 128), math.ceil(tensor.shape[1] / 128))
            assert got[name + "_scale_inv"].shape == blocks
            ref_q, ref_s = _reference_quantize(tensor)  # from the model's own (fp32) values, not the bf16 cast
            assert torch.equal(got[name].view(torch.uint8), ref_q.view(torch.uint8)), name
            assert torch.equal(got[name + "_scale_inv"], ref_s), name
        else:  # kept in high precision, cast as asked
            assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
    if model_type != "qwen3_moe":  # the bound counts FP8 bytes plus scales (a fused MoE tensor is one unit)
        buckets = list(hf_weight_stream(model, quantize="fp8_blockwise", bucket_bytes=10_000))
        sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
        assert all(size <= 10_000 or len(b) <= 2 for size, b in zip(sizes, buckets))
        assert max(len(b) for b in buckets) >= 4  # two 64x64 FP8 weights (8 KiB) fit where one fp32 one would not
    if model_type == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in got
        assert got["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("model_type, keep", [("qwen3_moe", ()), ("llama", ("model.layers.1.mlp",))])
def test_fp8_checkpoint_loads_in_transformers(tmp_path, model_type, keep):
    """transformers' own FP8 loader reads the exported directory (on a CPU it dequantizes, as it does for any FP8
    checkpoint without a GPU): nothing missing or unexpected, every weight equal to our dequantization."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    model = build_tiny_model(model_type)
    scheme = BlockwiseFP8(modules_to_not_convert=keep)
    streamed = dict(iter_tensors(hf_weight_stream(model, quantize=scheme)))
    config = model.config
    config.quantization_config = scheme.hf_quantization_config(model)
    assert config.quantization_config["modules_to_not_convert"] == sorted(
        ["lm_head"] + [f"model.layers.1.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj") if keep])
    save_sharded_safetensors(hf_weight_stream(model, quantize=scheme), str(tmp_path / "fp8"), config=config)
    del config.quantization_config
    loaded, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32,
                                                        output_loading_info=True)
    assert not any(info.values()), info
    got = revert_weight_conversion(loaded, dict(loaded.state_dict()))
    if keep:
        assert "model.layers.1.mlp.up_proj.weight_scale_inv" not in streamed
        assert "model.layers.0.mlp.up_proj.weight_scale_inv" in streamed
    for name, tensor in got.items():
        if name + "_scale_inv" in streamed:
            want = dequantize_fp8_blockwise(streamed[name], streamed[name + "_scale_inv"])
        else:
            want = streamed[name]
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want), name


def test_skip_patterns_match_at_module_boundaries():
    from actorcore.export.fp8 import DEFAULT_MODULES_TO_NOT_CONVERT, matches_module

    skips = list(DEFAULT_MODULES_TO_NOT_CONVERT) + ["model.layers.1"]
    assert matches_module("model.layers.3.mlp.gate", skips) and matches_module("lm_head", skips)
    assert matches_module("model.layers.1.mlp.up_proj", skips)
    assert matches_module("model.layers.2.mlp.shared_expert_gate", skips)
    assert not matches_module("model.layers.3.mlp.gate_proj", skips)
    assert not matches_module("model.layers.11.mlp.up_proj", skips)


def test_nan_is_refused_too():
    w = torch.zeros(200, 300)
    w[150, 250] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8_blockwise(w)
