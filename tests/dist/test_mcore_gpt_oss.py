"""gpt-oss's MXFP4 checkpoints on the Megatron route (gloo, CPU, EP=2): the experts, stored as MXFP4 blocks + scales
(quantised by a plain reference quantiser, not actorcore's), load into Megatron as exactly the values transformers'
own dequantiser gives; the model's log-probs equal transformers' fp32 forward on those weights; the export writes
them back in bf16 bit-exact, and re-quantised to MXFP4 as the very same blocks and scales.

(The bf16 round trips at TP / PP / EP, the log-probs at PP=2 / EP=2 and the TP=2 training run in the registry-driven
tests: test_mcore_roundtrip.py, test_mcore_logprobs.py, test_mcore_moe_tp.py.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

from support.mcore_cases import spawn_cases
from actorcore.testing.tolerances import TOL


pytest.importorskip("megatron.core")

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# MXFP4 blocks run along the input dim in 32s: the expert width must be a multiple of 32 (the tiny config's 88 is not).
OVERRIDES = dict(intermediate_size=96)


def _hf_model():
    from support.mcore_weights import randomize_constant_tensors

    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("gpt_oss", seed=11, **OVERRIDES)
    randomize_constant_tensors(model, seed=2)
    return model


def _save_mxfp4(directory: str) -> None:
    """The tiny model as a release stores it: experts as ``*_blocks`` / ``*_scales``, everything else bf16."""
    from safetensors.torch import save_file

    from support.mxfp4_reference import reference_quantize_mxfp4

    model = _hf_model()
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(EXPERTS):  # [E, in, out] -> stored [E, out, in / 32, ...]
            state[name + "_blocks"], state[name + "_scales"] = reference_quantize_mxfp4(tensor.transpose(-1, -2))
        else:
            state[name] = tensor.to(torch.bfloat16).contiguous()
    os.makedirs(directory)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config.update(dtype="bfloat16", quantization_config={"quant_method": "mxfp4",
                                                         "modules_to_not_convert": ["model.layers.*.self_attn"]})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def _dequantized_reference(directory: str) -> dict[str, torch.Tensor]:
    """The checkpoint in bf16, the experts dequantised by transformers' own MXFP4 code."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = load_file(os.path.join(directory, "model.safetensors"))
    out = {}
    for name, tensor in stored.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            out[base] = convert_moe_packed_tensors(tensor, stored[base + "_scales"], dtype=torch.bfloat16)
        else:
            out[name] = tensor
    return out


def _mxfp4_case(directory: str) -> dict:
    from actorcore.archs import get_spec
    from actorcore.export.mxfp4 import quantize_stream_mxfp4
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.safetensors_reader import safetensors_dtype
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict, mcore_weight_stream
    from support.mcore_logprobs import logprob_batches
    from transformers import AutoConfig

    parallel = McoreParallel(ep=2)
    initialize_megatron(parallel)
    config = AutoConfig.from_pretrained(directory)
    dtype = safetensors_dtype(directory)
    model = build_gpt_model(config, parallel, dtype)
    load_hf_into_mcore(model, directory)  # each EP rank dequantises only its experts' rows
    bf16 = gather_hf_state_dict(model)
    mxfp4 = {name: tensor for bucket in quantize_stream_mxfp4(mcore_weight_stream(model),
                                                              get_spec("gpt_oss").mcore.mxfp4_weights)
             for name, tensor in bucket}
    # The same checkpoint into an fp32 model (bf16 -> fp32 is exact), for log-probs against the fp32 reference.
    fp32 = build_gpt_model(config, parallel, torch.float32)
    load_hf_into_mcore(fp32, directory)
    got = compute_logprobs(fp32, logprob_batches())
    return {"dtype": dtype, "bf16": bf16, "mxfp4": mxfp4, "got": [(o.log_probs, o.entropy) for o in got]}


@pytest.fixture(scope="module")
def mxfp4_run(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gpt_oss_mxfp4") / "hf")
    _save_mxfp4(directory)
    return directory, spawn_cases(2, [("mxfp4", _mxfp4_case, (directory,))])["mxfp4"]


@pytest.mark.slow
def test_mxfp4_checkpoint_loads_dequantised_and_exports_both_ways(mxfp4_run):
    from safetensors.torch import load_file

    directory, results = mxfp4_run
    reference = _dequantized_reference(directory)
    stored = load_file(os.path.join(directory, "model.safetensors"))
    assert any(name.endswith("_blocks") for name in stored)
    for rank, result in enumerate(results):
        assert result["dtype"] == torch.bfloat16
        assert sorted(result["bf16"]) == sorted(reference), set(result["bf16"]) ^ set(reference)
        for name, tensor in reference.items():
            got = result["bf16"][name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), f"rank {rank}: {name}"
        assert sorted(result["mxfp4"]) == sorted(stored), set(result["mxfp4"]) ^ set(stored)
        for name, tensor in stored.items():
            got = result["mxfp4"][name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), f"rank {rank}: {name}"


@pytest.mark.slow
def test_mxfp4_checkpoint_logprobs_match_transformers(mxfp4_run):
    """The reference: transformers' fp32 forward with the dequantised weights (not actorcore's HF route)."""
    from support.mcore_logprobs import logprob_sequences, reference_logprobs_packed

    directory, results = mxfp4_run
    hf = _hf_model()
    hf.load_state_dict({name: tensor.float() for name, tensor in _dequantized_reference(directory).items()})
    with torch.no_grad():
        ref = [reference_logprobs_packed(hf, sequences) for sequences in logprob_sequences()]
    for result in results:
        for (lp, ent), (ref_lp, ref_ent) in zip(result["got"], ref):
            torch.testing.assert_close(lp, ref_lp, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
