"""The Megatron route's speed paths on one GPU (NCCL, one rank), bf16: the compiled layers (``mcore/build/layer.py``, Inductor's
Triton kernels), the grouped experts on torch's ``grouped_mm`` and on quack's gated GEMMs
(``mcore/build/grouped_experts.py``) and the budgeted recompute (``mcore/build/recompute.py``).

- Per token and per gradient, the route's defaults on CUDA (``"auto"``: compiled layers, grouped or quack experts)
  against megatron-core's eager layers and sequential experts with the same bf16 weights: within bf16 rounding
  (log-probs absolute, gradients as a relative L2 norm), and no further from transformers' fp32 forward than the
  eager route (the table's factor and floor); the defaults resolve as documented (fp32 stays unfused), and the
  trace proves the compiled layers and the grouped experts ran.
- quack's experts (on one rank: on the tokens, without the dispatcher) against the grouped_mm ones behind
  Megatron's dispatcher (skipped where quack does not run).
- ``recompute="auto"`` on a budget: the first call plans from the estimate and measures what each kept layer
  holds, the second plans with the measurement and stays within the budget; every mode's gradients within bf16
  rounding of no recompute (CUDA's attention and scatter backward kernels add with atomics: not bitwise here; the
  CPU test is, tests/dist/test_mcore_speed.py).

Needs megatron-core (carried as a wheel to the GPU machine) and Triton; skipped without CUDA.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter

import pytest
import torch

from actorcore.testing.tolerances import TOL


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "dist"))

MODEL_TYPES = ("qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")


def _batches():
    import actorcore as ac
    from support.mcore_logprobs import logprob_sequences

    return [ac.pack(sequences) for sequences in logprob_sequences()]


def _step(model, trace: Counter, fused_loss: bool = False) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One forward-backward of the summed log-probs: (log-probs per batch, every gradient as HF names);
    ``fused_loss``: the same loss through ``compute_loss``'s loss-fused head."""
    from support.mcore_moe_tp import grads_as_hf

    from actorcore.mcore import compute_loss
    from actorcore.mcore.run.forward import compute_logprobs

    for chunk in model.chunks:
        chunk.zero_grad(set_to_none=True)
    batches = _batches()
    if fused_loss:
        out = compute_loss(model, batches, lambda lp, ent: -lp, [()] * len(batches), entropy=False, trace=trace)
        return [o.logprob for o in out], grads_as_hf(model)
    out = compute_logprobs(model, batches, loss_fn=lambda o, b: -o.log_probs.sum(), trace=trace)
    return [o.log_probs for o in out], grads_as_hf(model)


def _variants_worker(rank: int, world_size: int, directory: str, variants: dict) -> dict:
    from support.mcore_moe_tp_cuda import on_cpu
    from transformers import AutoConfig

    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    initialize_megatron(McoreParallel())
    config = AutoConfig.from_pretrained(directory)
    out = {}
    for name, (dtype, options) in variants.items():
        options = dict(options)
        fused_loss = options.pop("fused_loss", False)
        model = build_gpt_model(config, McoreParallel(), dtype, **options)
        load_hf_into_mcore(model, directory)
        trace = Counter()
        out[name] = on_cpu((*_step(model, trace, fused_loss), dict(trace), model.moe_experts, model.compiled_layers))
        del model
        torch.cuda.empty_cache()
    return out


def _run(directory: str, variants: dict) -> dict:
    from support.mcore_nccl import run_nccl

    return run_nccl(_variants_worker, 1, (directory, variants))[0]


def _fp32_reference(hf) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """transformers' own fp32 forward on the CPU, and its gradients of the same loss (Megatron averages it over the
    micro-batches)."""
    from support.mcore_logprobs import logprob_sequences, reference_logprobs_packed

    hf.zero_grad()
    log_probs = []
    for sequences in logprob_sequences():
        lp = reference_logprobs_packed(hf, sequences)[0]
        (lp.sum() * (-1.0 / len(logprob_sequences()))).backward()
        log_probs.append(lp.detach())
    return log_probs, {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}


def _distance(result, reference) -> tuple[float, dict[str, float]]:
    """Max |Δ log-prob| and each gradient's relative L2 distance to the fp32 reference."""
    (lp, grads), (ref_lp, ref_grads) = result[:2], reference
    lp_distance = max((a.float() - b).abs().max().item() for a, b in zip(lp, ref_lp))
    return lp_distance, {n: ((grads[n].float() - g).norm() / g.norm().clamp(min=1e-12)).item()
                         for n, g in ref_grads.items()}


def _assert_within_bf16_rounding(got, want, where: str) -> None:
    (lp, grads), (want_lp, want_grads) = got[:2], want[:2]
    for a, b in zip(lp, want_lp):
        torch.testing.assert_close(a, b, atol=TOL["compiled_decoder_vs_eager_bf16"], rtol=0, msg=where)
    assert sorted(grads) == sorted(want_grads), where
    for name, grad in want_grads.items():
        diff = (grads[name].float() - grad.float()).norm()
        assert diff <= TOL["grad_compiled_decoder_vs_eager_bf16_rel_norm"] * grad.float().norm() + 1e-6, (where, name)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_defaults_within_bf16_rounding_of_eager_and_as_close_to_fp32(model_type):
    pytest.importorskip("megatron.core")
    pytest.importorskip("triton")
    from support.mcore_logprobs import tiny_hf

    hf = tiny_hf(model_type)
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        results = _run(directory, {
            "eager": (torch.bfloat16, dict(moe_experts="sequential", compiled_layers=False)),
            "defaults": (torch.bfloat16, {}),
            "fp32_defaults": (torch.float32, {}),
        })
    eager, defaults, fp32 = results["eager"], results["defaults"], results["fp32_defaults"]
    moe = model_type != "qwen3"
    assert defaults[4] is True and fp32[4] is False  # fused in bf16 on CUDA, fp32 unchanged
    assert defaults[2]["mcore:compiled_layers"] >= 2 * len(_batches())
    if model_type.startswith("qwen3"):  # q/k norms: fused on the QKV projection's views (mcore/build/qk_norm.py)
        assert defaults[2]["mcore:fused_qk_norm"] == defaults[2]["mcore:compiled_layers"]
    if moe:
        assert defaults[3] in ("grouped", "quack") and fp32[3] == "grouped" and eager[3] == "sequential"
        assert defaults[2]["moe_experts:grouped_calls"] >= len(_batches())
    _assert_within_bf16_rounding(defaults, eager, f"{model_type} defaults vs eager")
    reference = _fp32_reference(hf)
    (lp_eager, grads_eager), (lp_path, grads_path) = _distance(eager, reference), _distance(defaults, reference)
    factor, floor = TOL["moe_path_vs_fp32_over_transformers_factor"], TOL["moe_path_vs_fp32_over_transformers_floor"]
    assert lp_path <= factor * lp_eager + floor, (lp_path, lp_eager)
    worse = {n: (grads_path[n], grads_eager[n]) for n in grads_eager if grads_path[n] > factor * grads_eager[n] + floor}
    assert not worse, worse
    assert _distance(fp32, reference)[0] <= TOL["mcore_cuda_vs_hf_fp32"] * 10  # the fp32 model: TF32 off, eager


def test_quack_experts_within_bf16_rounding_of_grouped_mm():
    pytest.importorskip("megatron.core")
    from actorcore.kernels.quack.runtime import quack_refusal

    if quack_refusal() is not None:
        pytest.skip(quack_refusal())
    from support.mcore_logprobs import tiny_hf

    with tempfile.TemporaryDirectory() as directory:
        tiny_hf("qwen3_moe", moe_intermediate_size=48).save_pretrained(directory)  # widths multiples of 8
        results = _run(directory, {
            "grouped": (torch.bfloat16, dict(moe_experts="grouped", compiled_layers=False)),
            "quack": (torch.bfloat16, dict(moe_experts="quack", compiled_layers=False)),
            "grouped_fused": (torch.bfloat16, dict(moe_experts="grouped", compiled_layers=True)),
            "quack_fused": (torch.bfloat16, dict(moe_experts="quack", compiled_layers=True))})
    for quack, grouped in (("quack", "grouped"), ("quack_fused", "grouped_fused")):  # eager / compiled row passes
        quack_trace, grouped_trace = results[quack][2], results[grouped][2]
        assert results[quack][3] == "quack" and quack_trace["moe_experts:quack_calls"] >= len(_batches())
        # one rank holds every expert: quack's kernel takes the tokens, the dispatcher runs only for grouped_mm
        assert quack_trace["mcore:local_experts"] == quack_trace["moe_experts:quack_calls"], quack_trace
        assert not quack_trace.get("mcore:gather_dispatch") and \
            grouped_trace["mcore:gather_dispatch"] >= len(_batches())
        _assert_within_bf16_rounding(results[quack], results[grouped], f"{quack} vs {grouped}")
    assert results["quack_fused"][4] is True and results["quack_fused"][2]["mcore:compiled_layers"] >= len(_batches())


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_fused_loss_head_matches_compute_logprobs_on_cuda(model_type):
    """``compute_loss`` (the loss inside the head, its Triton kernel) against ``compute_logprobs`` with the same
    summed loss, the route's defaults in bf16: per token and per gradient within bf16 rounding (the head's
    statistics are fp32 in both; the gradients meet bf16 in the decoder's backward)."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("triton")
    from support.mcore_logprobs import tiny_hf

    with tempfile.TemporaryDirectory() as directory:
        tiny_hf(model_type).save_pretrained(directory)
        results = _run(directory, {"logprobs": (torch.bfloat16, {}),
                                   "fused_loss": (torch.bfloat16, dict(fused_loss=True))})
    trace = results["fused_loss"][2]
    assert trace["mcore:fused_loss"] == len(_batches()) and trace["logprob:triton_fused_loss"] >= len(_batches())
    assert not results["logprobs"][2].get("mcore:fused_loss")
    _assert_within_bf16_rounding(results["fused_loss"], results["logprobs"], f"{model_type} fused loss")


def _budget_worker(rank: int, world_size: int, directory: str) -> dict:
    from support.mcore_moe_tp_cuda import on_cpu
    from transformers import AutoConfig

    from actorcore.mcore.run.call_plan import _has_local_experts, _is_moe, decoder_layers, gradient_bytes_to_come
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.build.recompute import SLACK_BYTES, layer_bytes_per_token

    import actorcore as ac

    initialize_megatron(McoreParallel())
    config = AutoConfig.from_pretrained(directory)
    g = torch.Generator().manual_seed(0)
    batch = ac.pack([torch.randint(3, 4096, (int(n),), generator=g) for n in torch.randint(300, 1500, (16,),
                                                                                            generator=g)])
    out = {}
    for mode in (None, "full", "selective", "auto"):
        probe = build_gpt_model(config, McoreParallel(), torch.bfloat16, compiled_layers=True)
        load_hf_into_mcore(probe, directory)
        options = {"recompute": mode}
        if mode == "auto":  # room for about half the layers selectively, on top of what is allocated now and the
            # gradients (two micro-batches: the second runs with the first one's gradients)
            estimates = [layer_bytes_per_token(probe.config, 2, _is_moe(layer), _has_local_experts(layer))
                         for layer in decoder_layers(probe)]
            base = (torch.cuda.memory_allocated() + gradient_bytes_to_come(probe) + SLACK_BYTES
                    + sum(e[2] for e in estimates) * batch.num_tokens)
            budget = base + 0.5 * sum(e[1] for e in estimates) * batch.num_tokens
            options["memory_budget_gib"] = budget / 2**30
        del probe
        model = build_gpt_model(config, McoreParallel(), torch.bfloat16, compiled_layers=True, **options)
        load_hf_into_mcore(model, directory)
        from actorcore.mcore.run.forward import compute_logprobs

        runs = []
        for _ in range(2):
            for chunk in model.chunks:
                chunk.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            trace = Counter()
            batches = [batch, batch] if mode == "auto" else batch
            result = compute_logprobs(model, batches, loss_fn=lambda o, b: -o.log_probs.sum(), trace=trace)
            lp = (result[0] if mode == "auto" else result).log_probs
            grads = {n: p.grad for n, p in model.chunks[0].named_parameters() if p.grad is not None}
            runs.append(on_cpu((lp, grads, dict(trace), torch.cuda.max_memory_allocated())))
        out[str(mode)] = (runs, dict(model.measured_layer_bytes), options.get("memory_budget_gib"))
        del model
        torch.cuda.empty_cache()
    return out


def test_recompute_modes_and_the_budget_on_cuda():
    pytest.importorskip("megatron.core")
    pytest.importorskip("triton")
    from support.mcore_nccl import run_nccl

    from actorcore.testing.tiny_configs import build_tiny_model

    hf = build_tiny_model("qwen3_moe", seed=0, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                          num_experts=16, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=128, num_hidden_layers=8, vocab_size=4096, mlp_only_layers=[1])
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        result = run_nccl(_budget_worker, 1, (directory,))[0]
    none_runs = result["None"][0]
    layers = 8
    for mode, key in (("full", "mcore:recompute_full_layers"), ("selective", "mcore:recompute_selective_layers")):
        runs = result[mode][0]
        assert runs[0][2][key] == layers, mode
        assert runs[0][3] < none_runs[0][3], mode  # it keeps less
        lp, grads = runs[0][:2]
        _assert_within_bf16_rounding(([lp], {n: g for n, g in grads.items()}), ([none_runs[0][0]], none_runs[0][1]),
                                     mode)
    (first, second), measured, budget_gib = result["auto"]
    assert 0 < first[2].get("mcore:recompute_selective_layers", 0) + first[2].get("mcore:recompute_kept_layers", 0)
    assert first[2].get("mcore:recompute_full_layers", 0) > 0  # half the layers' room: some recomputed whole
    # what each layer measured keeping beyond its output: > 0 where it keeps activations; a fully recomputed layer
    # keeps only its input, the previous layer's output (no new allocation): 0 there
    assert measured and all(value > 0 if mode != "full" else value >= 0 for (_, mode), value in measured.items()), \
        measured
    assert second[3] <= budget_gib * 2**30, (second[3], budget_gib)
