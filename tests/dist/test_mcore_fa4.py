"""The Megatron route's core attention on the FA4 backend (``mcore.build.attention.use_attention_backend``), one gloo rank on
the CPU: flash-attn-4's entry points are the stand-in of ``actorcore.testing.fa4_stand_in`` (the kernels need a Hopper
GPU), so what is proven is the route's side: every core attention runs the backend it is given, with gpt-oss's
sinks (``softmax_offset``) and its sliding-window layer, forward and backward through Megatron's schedule, and the
log-probs and gradients equal transformers' fp32 forward per token."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from support.mcore_cases import spawn_cases
from actorcore.testing.tolerances import TOL


pytest.importorskip("megatron.core")


def _fa4_case(directory: str) -> dict:
    from support.mcore_logprobs import logprob_batches, logprob_sequences, tiny_hf, reference_logprobs_packed

    from actorcore.mcore.build.attention import use_attention_backend
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.testing.fa4_stand_in import use_fa4_stand_in

    hf = tiny_hf("gpt_oss")
    initialize_megatron(McoreParallel())
    model = build_gpt_model(hf.config, McoreParallel())
    load_hf_into_mcore(model, directory)
    try:
        use_attention_backend(model, "flash_attention_3")
    except ValueError as refused:
        refusal = str(refused)
    stand_in, undo = use_fa4_stand_in()
    try:
        modules = use_attention_backend(model, "fa4")
        trace = Counter()
        for module in modules:
            module.trace = trace
        got = compute_logprobs(model, logprob_batches(), loss_fn=lambda out, batch: -out.log_probs.sum())
    finally:
        undo()
    hf.zero_grad()
    for sequences in logprob_sequences():
        (reference_logprobs_packed(hf, sequences)[0].sum() * (-1.0 / len(logprob_batches()))).backward()
    grad = next(p.grad for n, p in model.chunks[0].named_parameters() if n == "decoder.final_layernorm.weight")
    with torch.no_grad():
        ref = [reference_logprobs_packed(hf, sequences)[0] for sequences in logprob_sequences()]
    return {"got": [o.log_probs for o in got], "ref": ref, "trace": dict(trace), "layers": len(modules),
            "windows": [m.sliding_window for m in modules], "calls": [kind for kind, _ in stand_in.calls],
            "sinks": {call["sink"] for _, call in stand_in.calls}, "refusal": refusal,
            "grad": (grad, hf.model.norm.weight.grad.clone())}


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    from support.mcore_logprobs import tiny_hf

    directory = os.path.join(str(tmp_path_factory.mktemp("mcore_fa4")), "gpt_oss")
    tiny_hf("gpt_oss").save_pretrained(directory)
    return spawn_cases(1, [("fa4", _fa4_case, (directory,))])


def test_core_attention_runs_fa4_with_sinks_and_windows(world1):
    (result,) = world1["fa4"]
    assert "attention backend must be one of" in result["refusal"]
    layers, packs = result["layers"], len(result["got"])
    assert layers == 2 and None in result["windows"] and any(result["windows"])  # a sliding and a full layer
    assert result["trace"] == {"varlen_attention:fa4": layers * packs}  # every layer, every pack, nothing else
    assert Counter(result["calls"]) == {"forward": layers * packs, "backward": layers * packs}
    assert result["sinks"] == {True}
    for lp, ref in zip(result["got"], result["ref"]):
        torch.testing.assert_close(lp, ref, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
    grad, ref_grad = result["grad"]
    torch.testing.assert_close(grad, ref_grad, atol=TOL["grad_mcore_vs_hf_fp32_rel"] * ref_grad.abs().max(), rtol=0)
