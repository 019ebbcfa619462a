"""quack's gated MLP (``patch_model(swiglu_mlp=...)``, ``hf.features.swiglu_mlp``, ``kernels.quack.gated_mlp``): what
runs without a GPU. quack's kernels themselves run on the H200 (``tests/gpu/test_swiglu_mlp_quack_cuda.py``); here
a stand-in for its two gated GEMMs, written from quack's documented semantics (``testing.quack_stand_in``: gate and
up interleaved column by column, SwiGLU and its gradient from the accumulators), checks the arithmetic around them in fp32 per
element against the model's own MLP and per token against the model's own forward: the interleaved weight, the
cuBLAS GEMMs, the gradients read back as the projections'. Also: which MLPs are covered, the option's values and
refusals, ``"auto"`` with quack faked present, the trace proving the path ran (a bypassed class raises), the model's
own forward keeping its MLP code, ``revert``, ``copy.deepcopy`` and ``torch.save``."""

from __future__ import annotations

import copy
import io
from collections import Counter

import pytest
import torch

import actorcore as ac
import actorcore.hf.features.swiglu_mlp as swiglu_mlp
import actorcore.kernels.quack.gated_mlp as quack_gated_mlp
import actorcore.kernels.quack.runtime as quack_runtime
from actorcore.archs import spec_for_model
from actorcore.errors import PatchNotAppliedError
from actorcore.hf.call import DecoderParts
from actorcore.hf.features.swiglu_mlp import SWIGLU_MLP_KEY, QuackGatedMLP, swiglu_mlp_names, mlp_refusal
from actorcore.testing.quack_stand_in import use_quack_stand_in
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

COVERED = ("llama", "qwen2", "qwen3", "mistral", "granite", "olmo2", "deepseek_v3", "qwen2_moe", "qwen3_next")
TEMPERATURE = 0.9


@pytest.fixture
def quack_stand_in():
    """quack present (faked) and the path running in fp32 on the CPU: ``testing.quack_stand_in``'s GEMMs, the 16-bit
    CUDA checks lifted."""
    undo = use_quack_stand_in()
    yield
    undo()


def _mlps(model, names):
    return [model.model.get_submodule(name) for name in names]


def test_function_matches_the_models_mlp_per_element(quack_stand_in):
    """The Function's output and every gradient (input, gate, up, down) against the model's own MLP module in fp32."""
    model = build_tiny_model("qwen2", seed=3)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 9, model.config.hidden_size, requires_grad=True)
    grad = torch.randn(2, 9, model.config.hidden_size)
    want = mlp(x)
    want_grads = torch.autograd.grad(want, (x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight), grad)
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    got = quack_gated_mlp._GatedMLP.apply(x.reshape(-1, x.shape[-1]), *weights, None, True).view_as(want)
    got_grads = torch.autograd.grad(got, (x, *weights), grad)
    tol = TOL["gated_mlp_arithmetic_fp32"]
    assert (want - got).abs().max().item() <= tol * want.abs().max().item()
    for w, g in zip(want_grads, got_grads):
        assert w.shape == g.shape and (w - g).abs().max().item() <= tol * w.abs().max().item()


def _saved_shapes(fn):
    """``(fn(), the shapes of the tensors autograd saved while it ran)``."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        result = fn()
    return result, shapes


def test_function_without_the_kept_preactivation_is_bitwise(quack_stand_in, monkeypatch):
    """``keep_preact=False``: no ``[T, 2I]`` tensor saved, the gate/up GEMM run again in backward (counted), and the
    output and every gradient bitwise those of the Function that keeps it."""
    model = build_tiny_model("qwen2", seed=3)
    mlp = model.model.layers[0].mlp
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    x = torch.randn(18, model.config.hidden_size, requires_grad=True)
    grad = torch.randn(18, model.config.hidden_size)
    stand_in, calls = quack_runtime.gemm_interface(), []
    gemm_gated = stand_in.gemm_gated
    monkeypatch.setattr(stand_in, "gemm_gated",
                        staticmethod(lambda *a, **k: calls.append(k["store_preact"]) or gemm_gated(*a, **k)))
    runs = {}
    for keep in (True, False):
        out, shapes = _saved_shapes(lambda: quack_gated_mlp._GatedMLP.apply(x, *weights, None, keep))
        runs[keep] = (out, *torch.autograd.grad(out, (x, *weights), grad)), shapes
    assert calls == [True, False, True]  # kept: one GEMM; recomputed: forward without the pre-activation, then again
    preact = (18, 2 * model.config.intermediate_size)
    assert preact in runs[True][1] and preact not in runs[False][1]
    for a, b in zip(runs[True][0], runs[False][0]):
        assert torch.equal(a, b)


def test_gate_up_recomputed_sets_the_layers_mlps_for_one_call(quack_stand_in):
    """``gate_up_recomputed(layers)``: those layers' quack MLPs keep no pre-activation in the call (eager runs
    counted), the other layers' do, and nothing is left on the modules afterwards (also after an error)."""
    model = build_tiny_model("llama", seed=1, num_hidden_layers=3).train()
    handle = ac.patch_model(model, swiglu_mlp="quack")
    layers = model.model.layers
    assert [len(swiglu_mlp.quack_mlps(layer)) for layer in layers] == [1, 1, 1]
    batch = ac.pack([torch.arange(3, 40), torch.arange(5, 22)])
    preact = (batch.num_tokens, 2 * model.config.intermediate_size)

    def run():
        trace = Counter()
        out = ac.compute_logprobs(model, batch, trace=trace)
        return out, trace

    with swiglu_mlp.gate_up_recomputed(layers[1:]):
        assert [m.actorcore_recompute_gate_up for layer in layers for m in swiglu_mlp.quack_mlps(layer)] == \
            [False, True, True]
        (out, trace), shapes = _saved_shapes(run)
    assert trace[swiglu_mlp.GATE_UP_RECOMPUTED_KEY] == 2 and trace[SWIGLU_MLP_KEY] == 3
    assert shapes.count(preact) == 1  # layer 0's MLP keeps it
    with pytest.raises(RuntimeError, match="stop"):
        with swiglu_mlp.gate_up_recomputed(layers):
            raise RuntimeError("stop")
    assert not any("actorcore_recompute_gate_up" in m.__dict__ for m in model.modules())
    _, shapes = _saved_shapes(run)
    assert shapes.count(preact) == 3
    handle.revert()


def test_gated_mlp_refuses_fp32_and_mixed_dtypes():
    w = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        quack_gated_mlp.gated_mlp(torch.zeros(3, 4), w, w, w)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        quack_gated_mlp.gated_mlp(torch.zeros(3, 4, dtype=torch.bfloat16), w.half(), w.half(), w.half())


@pytest.mark.parametrize("model_type", ("qwen2", "qwen3_next"))
def test_patched_model_matches_its_own_forward_and_ran(quack_stand_in, model_type):
    """Per token and per parameter gradient against the model's own forward (one sequence at a time, fp32), with
    ``swiglu_mlp="quack"``; the trace counts every installed MLP; a deep copy runs its own MLPs; ``revert`` restores
    the classes."""
    model = build_tiny_model(model_type, seed=2).train()
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 131, (n,), generator=g) for n in (7, 19, 1, 12)]

    def own_forward():
        lps = []
        for ids in sequences:
            logp = torch.log_softmax(model(input_ids=ids[None], use_cache=False).logits[0].float() / TEMPERATURE, -1)
            lps.append(torch.cat([logp.new_zeros(1), logp[:-1].gather(-1, ids[1:, None])[:, 0]]))
        lp = torch.cat(lps)
        (lp * torch.linspace(0.5, 1.5, lp.numel())).sum().backward()
        return lp.detach(), _grads(model)

    want_lp, want_grads = own_forward()
    handle = ac.patch_model(model, swiglu_mlp="quack")
    mlps = _mlps(model, handle.state.targets("swiglu_mlp"))
    assert mlps and all(isinstance(m, QuackGatedMLP) for m in mlps)
    trace = Counter()
    out = ac.compute_logprobs(model, ac.pack(sequences), temperature=TEMPERATURE, trace=trace)
    (out.log_probs * torch.linspace(0.5, 1.5, out.log_probs.numel())).sum().backward()
    assert trace[SWIGLU_MLP_KEY] == len(mlps)
    assert (out.log_probs - want_lp).abs().max().item() < TOL["packed_vs_hf_fp32"]
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys()
    hybrid = spec_for_model(model).linear_attention is not None  # the decay parameters sum over the recurrence
    rel = TOL["grad_hybrid_moe_vs_hf_fp32_rel" if hybrid else "grad_packed_vs_hf_fp32_rel"]
    for name, want in want_grads.items():
        tol = rel * max(want.abs().max().item(), 1e-12)
        assert (want - got_grads[name]).abs().max().item() <= tol, name

    # the model's own forward (not an actorcore call) keeps its MLP code: same as before the patch, bitwise
    again_lp, _ = own_forward()
    assert torch.equal(again_lp, want_lp)

    with torch.no_grad():
        want_lp = ac.compute_logprobs(model, ac.pack(sequences), temperature=TEMPERATURE).log_probs
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the path class is made at run time: pickled through its base (reduce_to_path_class)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        trace = Counter()
        with torch.no_grad():
            got_lp = ac.compute_logprobs(clone, ac.pack(sequences), temperature=TEMPERATURE, trace=trace).log_probs
        assert trace[SWIGLU_MLP_KEY] == len(mlps) and torch.equal(got_lp, want_lp)
        assert all(isinstance(m, QuackGatedMLP) for m in _mlps(clone, handle.state.targets("swiglu_mlp")))

    handle.revert()
    assert not any(isinstance(m, QuackGatedMLP) for m in model.modules())


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_a_bypassed_mlp_raises(quack_stand_in):
    model = build_tiny_model("llama", seed=1)
    handle = ac.patch_model(model, swiglu_mlp="quack")
    mlp = _mlps(model, handle.state.targets("swiglu_mlp"))[0]
    mlp.__class__ = mlp._actorcore_base  # what a transformers that swaps the module's class would do
    with pytest.raises(PatchNotAppliedError, match=r"quack's gated MLP ran in 1 of 2 MLP modules"):
        ac.compute_logprobs(model, ac.pack([torch.arange(3, 12)]))


@pytest.mark.parametrize("model_type", COVERED)
def test_covers_the_gated_silu_mlps(model_type):
    """The math is covered in every family with Llama's gated MLP code; on the CPU in fp32 the device refuses."""
    model = build_tiny_model(model_type)
    mlps = [m for m in model.modules() if hasattr(m, "gate_proj")]
    assert mlps and all(mlp_refusal(m) == f"{type(m).__name__} is not a 16-bit CUDA module" for m in mlps)


def test_refuses_what_it_does_not_cover():
    gemma = build_tiny_model("gemma3_text").model.layers[0].mlp
    assert "not SiLU" in mlp_refusal(gemma)
    llama = build_tiny_model("llama").model.layers[0].mlp
    llama.up_proj = torch.nn.Linear(llama.up_proj.in_features, llama.up_proj.out_features, bias=True)
    assert "not plain nn.Linear without bias" in mlp_refusal(llama)

    class OtherMLP(type(llama)):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    llama.__class__ = OtherMLP
    assert "is not transformers' gated MLP" in mlp_refusal(llama)


def test_request_values_and_refusals():
    model = build_tiny_model("qwen2")
    with pytest.raises(ValueError, match=r"swiglu_mlp must be 'auto', 'quack' or False, got 'quak'"):
        ac.patch_model(model, swiglu_mlp="quak")
    with pytest.raises(ValueError, match=r"swiglu_mlp='quack': .*(Hopper|not installed)"):
        ac.patch_model(model, swiglu_mlp="quack")
    for request in ("auto", False):  # the CPU: nothing fused, nothing installed
        handle = ac.patch_model(model, swiglu_mlp=request)
        assert handle.state.targets("swiglu_mlp") == ()
        handle.revert()


def test_auto_takes_the_compiled_layers_where_quack_runs(monkeypatch):
    """``"auto"``: the covered MLPs of the compiled layers when quack runs (faked: the CPU has no Hopper GPU), none
    where quack refuses or nothing is compiled."""
    model = build_tiny_model("qwen2")
    spec = spec_for_model(model)
    parts = DecoderParts.of(model, spec)
    monkeypatch.setattr(swiglu_mlp, "_device_refusal", lambda module: None)
    monkeypatch.setattr(quack_runtime, "quack_refusal", lambda: None)
    assert swiglu_mlp_names(model, parts, spec, "auto", compiled_layers=(1,))[0] == ("layers.1.mlp",)
    assert swiglu_mlp_names(model, parts, spec, "auto", compiled_layers=())[0] == ()
    monkeypatch.setattr(quack_runtime, "quack_refusal", lambda: "quack-kernels is not installed")
    assert swiglu_mlp_names(model, parts, spec, "auto", compiled_layers=(0, 1)) == ((), "quack-kernels is not installed")


def test_widths_quack_cannot_load_are_refused():
    """quack's tile loads move 16-byte rows: 16-bit widths must be multiples of 8 (checked before the first GEMM,
    so ``"auto"`` keeps the model's own code instead of failing in it)."""
    from actorcore.kernels.quack.runtime import width_refusal

    assert width_refusal("Qwen2MLP", hidden=1536, intermediate=8960) is None
    why = width_refusal("Qwen2MLP", hidden=64, intermediate=90)
    assert "intermediate=90" in why and "hidden" not in why.split("(")[1]
