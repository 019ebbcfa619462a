"""CPU: the FA4 attention backend's selection, refusals and wiring (``kernels.attention.fa4`` / ``backends``).

The kernels need a Hopper GPU (tests/gpu/test_fa4_attention_cuda.py); here flash-attn-4's entry points are a stand-in
written from its interface (``actorcore.testing.fa4_stand_in``) that records its calls, so what is tested is actorcore's
side: which backend "auto" takes from the measured data, what is refused and why, the arguments passed (window
extent, softcap, sinks, int32 offsets), the custom ops' autograd and fake implementations (eager, and traced into a
compiled graph), the patch option and its check. Compared per element with the ``segments`` backend or the model's
own forward (fp64 / fp32).

Legend: ``T`` packed tokens, ``N`` query heads, ``K`` key/value heads, ``H`` head dim.
"""

from __future__ import annotations

from collections import Counter
from types import MappingProxyType

import pytest
import torch

import actorcore as ac
import actorcore.kernels.attention.backends as backends
import actorcore.kernels.attention.fa4 as fa4
from actorcore.errors import PackingNotAppliedError
from actorcore.hf.patch import is_patched
from actorcore.kernels.attention.varlen import varlen_causal_attention
from actorcore.testing.fa4_stand_in import use_fa4_stand_in
from actorcore.testing.reference import reference_logprobs, right_padded
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

CUDA = torch.device("cuda")  # a device object only: nothing here runs on it


@pytest.fixture
def stand_in():
    fake, undo = use_fa4_stand_in()
    yield fake
    undo()


@pytest.fixture
def hopper(monkeypatch):
    """A Hopper GPU with the tested flash-attn-4 installed, as the probes see it (for the choice; nothing runs)."""
    monkeypatch.setattr(backends, "device_capability", lambda device: (9, 0) if device.type == "cuda" else None)
    monkeypatch.setattr(fa4, "installed_refusal", lambda: None)
    monkeypatch.setattr(backends, "_has_flash_attn", lambda: False)
    monkeypatch.setattr(backends, "_has_torch_varlen", lambda: True)


def _packed(lengths, heads=4, kv_heads=2, qk_dim=8, v_dim=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(sum(lengths), n, qk_dim, generator=g, dtype=dtype) for n in (heads, kv_heads))
    v = torch.randn(sum(lengths), kv_heads, v_dim, generator=g, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def test_fa4_refusals_name_the_reason(monkeypatch):
    monkeypatch.setattr(fa4, "installed_refusal", lambda: None)
    ok = dict(device=CUDA, dtype=torch.bfloat16, head_dim=128, capability=(9, 0))
    assert fa4.fa4_refusal(**ok) is None
    for change, words in ((dict(device=torch.device("cpu"), capability=None), "CUDA devices only"),
                          (dict(capability=(8, 0)), "Hopper (sm90) only"), (dict(capability=(10, 0)), "sm100"),
                          (dict(dtype=torch.float32), "fp16 / bf16"),
                          (dict(head_dim=16), "proven exact on the GPU, 64, 128, 256, not 16"),
                          (dict(head_dim=264), "not 264"), (dict(head_dim=96), "not 96")):
        assert words in fa4.fa4_refusal(**{**ok, **change}), change
    assert "no attention dropout" in fa4.fa4_refusal(**ok, dropout=0.1)
    assert fa4.fa4_refusal(**ok, window=True, softcap=True, sinks=True) is None  # all of FA4_FEATURES
    monkeypatch.setattr(fa4, "FA4_FEATURES", frozenset({"window"}))  # as if the GPU showed softcap and sinks wrong
    assert "with softcap, sinks (not in fa4.FA4_FEATURES)" in fa4.fa4_refusal(**ok, window=True, softcap=True,
                                                                              sinks=True)
    monkeypatch.setattr(fa4, "installed_refusal", lambda: "flash-attn-4 is not installed")
    assert fa4.fa4_refusal(**ok) == "flash-attn-4 is not installed"


def test_installed_refusal_takes_only_the_tested_release(monkeypatch):
    import importlib.metadata

    def version(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert "flash-attn-4 is not installed" in fa4.installed_refusal.__wrapped__()
    assert "actorcore[fa4]" in fa4.installed_refusal.__wrapped__()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.0b37")
    assert "flash-attn-4 4.0.0b37 is installed" in fa4.installed_refusal.__wrapped__()
    assert fa4.FA4_VERSION in fa4.installed_refusal.__wrapped__()


def test_flash_attn_2_is_probed_by_its_extension_not_the_shared_name(stand_in, monkeypatch):
    """flash-attn-4 installs ``flash_attn.cute`` without flash-attn 2's kernels: a ``flash_attn`` package alone must
    not make "auto" call flash-attn 2."""
    import importlib.util
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    seen = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: seen.append(name))
    assert backends._has_flash_attn.__wrapped__() is False and seen == ["flash_attn_2_cuda"]


def test_auto_takes_fa4_only_where_measured(hopper, monkeypatch):
    choose = lambda **kw: backends.choose_backend(  # noqa: E731
        CUDA, kw.pop("dtype", torch.bfloat16), kw.pop("softcap", None), kw.pop("dropout", 0.0),
        kw.pop("sinks", False), head_dim=kw.pop("head_dim", 128), **kw)
    monkeypatch.setattr(backends, "FA4_MEASURED", MappingProxyType({}))  # not measured: FA4 only when asked for
    assert (choose(), choose(sinks=True), choose(softcap=5.0)) == ("torch_varlen", "segments", "segments")

    monkeypatch.setattr(backends, "FA4_MEASURED", MappingProxyType({(9, 0): "exact"}))
    assert choose() == "torch_varlen"  # exact but not measured faster: FA2 keeps what it covers
    assert (choose(sinks=True), choose(softcap=5.0)) == ("fa4", "fa4")  # what only segments covered before
    monkeypatch.setattr(backends, "_has_flash_attn", lambda: True)
    assert (choose(softcap=5.0), choose(sinks=True)) == ("flash_attn", "fa4")  # flash-attn 2 has softcap

    monkeypatch.setattr(backends, "FA4_MEASURED", MappingProxyType({(9, 0): "faster"}))
    assert choose() == "fa4" and choose(dtype=torch.float16) == "fa4"
    assert choose(head_dim=512) == "flash_attn"  # FA4 refuses: the fallback
    assert choose(dropout=0.1) == "flash_attn"
    assert choose(head_dim=None) == "flash_attn" and choose(fa4=False) == "flash_attn"
    assert choose(dtype=torch.float32) == "segments"
    monkeypatch.setattr(fa4, "FA4_FEATURES", frozenset({"softcap"}))  # windows and sinks taken off the list
    assert (choose(window=True), choose(softcap=5.0), choose(sinks=True)) == ("flash_attn", "fa4", "segments")
    assert backends.choose_backend(torch.device("cpu"), torch.bfloat16, None, 0.0, head_dim=128) == "segments"
    monkeypatch.setattr(backends, "device_capability", lambda device: (10, 0))
    assert choose() == "flash_attn"  # not measured on that GPU


def test_resolve_backend_reports_the_choice_and_refuses_what_cannot_run(hopper, monkeypatch):
    resolve = lambda requested, **kw: backends.resolve_backend(  # noqa: E731
        requested, kw.pop("device", CUDA), kw.pop("dtype", torch.bfloat16), head_dim=kw.pop("head_dim", 128), **kw)
    monkeypatch.setattr(backends, "FA4_MEASURED", MappingProxyType({}))
    choice = resolve("auto")
    assert (choice.backend, choice.requested) == ("torch_varlen", "auto") and "FA4 not measured on sm90" in str(choice)
    assert "need CUDA and 16-bit" in resolve("auto", device=torch.device("cpu")).reason
    assert resolve("fa4").backend == "fa4" and resolve("fa4").reason == "asked for"
    with pytest.raises(ValueError, match="attention_backend='fa4': FA4 is taken for the head dims proven exact"):
        resolve("fa4", head_dim=576)
    with pytest.raises(ValueError, match="attention_backend='fa4': FA4 runs on CUDA devices only"):
        resolve("fa4", device=torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot apply attention sinks"):
        resolve("torch_varlen", sinks=True)
    with pytest.raises(ValueError, match="the torch_varlen backend runs fp16 / bf16 inputs on CUDA devices, not "
                                         "torch.float32 on cpu"):
        resolve("torch_varlen", device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="flash-attn 2 is not installed"):
        resolve("flash_attn")
    with pytest.raises(ValueError, match="unknown attention backend 'fa3'"):
        resolve("fa3")
    monkeypatch.setattr(backends, "FA4_MEASURED", MappingProxyType({(9, 0): "faster"}))
    assert str(resolve("auto")) == "fa4 (FA4 measured faster on sm90)"
    assert "head dims proven exact" in resolve("auto", head_dim=512).reason


def test_fa4_backend_per_element_with_windows_softcap_sinks_and_gqa(stand_in):
    """The FA4 path (custom ops, autograd, the arguments it passes) equals the per-sequence ``segments`` path per
    element, output and the gradients of q, k, v and the sinks, on ragged packs with 1-token sequences."""
    lengths = [1, 6, 2, 9, 1]
    for window, softcap, with_sinks, dims in ((None, None, False, (8, 8)), (3, None, False, (8, 8)),
                                              (None, 5.0, True, (8, 8)), (4, 2.0, True, (8, 8)),
                                              (None, None, False, (12, 8)), (2, None, True, (8, 16))):
        q, k, v, cu = _packed(lengths, qk_dim=dims[0], v_dim=dims[1], seed=len(stand_in.calls))
        sinks = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 2 \
            if with_sinks else None
        leaves = [x.requires_grad_() for x in (q, k, v) + ((sinks,) if with_sinks else ())]
        grad_out = torch.randn(sum(lengths), 4, dims[1], dtype=torch.float64)
        trace = Counter()
        kwargs = dict(scale=0.3, sliding_window=window, softcap=softcap, sinks=sinks)
        calls_before = len(stand_in.calls)
        fast = varlen_causal_attention(q, k, v, cu.long(), max(lengths), backend="fa4", trace=trace, **kwargs)
        assert trace == {"varlen_attention:fa4": 1}
        ref = varlen_causal_attention(q, k, v, cu, max(lengths), backend="segments", **kwargs)
        torch.testing.assert_close(fast, ref, rtol=0, atol=TOL["attention_fp64_vs_plain"])
        for got, want in zip(torch.autograd.grad(fast, leaves, grad_out), torch.autograd.grad(ref, leaves, grad_out)):
            torch.testing.assert_close(got, want, rtol=0, atol=TOL["attention_fp64_vs_plain"])
        (_, forward), (_, backward) = stand_in.calls[calls_before:]
        assert forward["causal"] and forward["window_size_right"] is None and forward["scale"] == 0.3
        assert forward["window_size_left"] == (None if window is None else window - 1)
        assert forward["softcap"] == (softcap or 0.0) and forward["sink"] == with_sinks
        assert backward["window_size_left"] == forward["window_size_left"] and backward["sink"] == with_sinks


def test_explicit_fa4_refused_where_it_cannot_run():
    q, k, v, cu = _packed([3, 2])
    with pytest.raises(ValueError, match="attention backend 'fa4' cannot run this call: FA4 runs on CUDA"):
        varlen_causal_attention(q, k, v, cu, 3, backend="fa4")
    trace = Counter()
    varlen_causal_attention(q, k, v, cu, 3, trace=trace)
    assert trace == {"varlen_attention:segments": 1}  # "auto" on the CPU: unchanged


def test_fa4_op_traces_into_a_compiled_layer_with_its_backward(stand_in, monkeypatch):
    """Inside a layer the compiled decoder compiles, FA4's custom op is one node of the graph (symbolic token count,
    its fake implementations), and the compiled forward and backward equal the eager ``segments`` path."""
    import actorcore.hf.features.attention as attention
    from actorcore.hf.features import compiled_decoder

    monkeypatch.setattr(attention, "traceable_backend", torch.compiler.assume_constant_result(
        lambda device_type, dtype, requested, head_dim, softcap, sinks, window: "fa4" if requested == "fa4" else ""))
    graphs = []

    def aot_eager_capture(gm, example_inputs):
        graphs.append(gm.graph)
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scaling, self.head_dim = 0.3, 8
            self.sinks = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))

        def forward(self, q, k, v, **kwargs):
            out, _ = attention.packed_attention_forward(self, q, k, v, None, scaling=self.scaling, softcap=4.0,
                                                        sliding_window=3, s_aux=self.sinks, **kwargs)
            return out * 2

    module = Attention().train()
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=aot_eager_capture)
    for lengths in ([3, 7], [5, 1, 6]):  # a second pack length reuses the graph
        q, k, v, cu = _packed(lengths)
        q, k, v = (x.transpose(0, 1).unsqueeze(0).requires_grad_() for x in (q, k, v))
        packing = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        with compiled_decoder.compile_settings():
            fast = compiled(q, k, v, **packing, **{attention.IN_GRAPH_KWARG: True,
                                                     attention.ATTENTION_BACKEND_KWARG: "fa4"})
        ref = 2 * varlen_causal_attention(*(x[0].transpose(0, 1) for x in (q, k, v)), cu, max(lengths), scale=0.3,
                                          softcap=4.0, sliding_window=3, sinks=module.sinks, backend="segments")
        torch.testing.assert_close(fast[0], ref, rtol=0, atol=TOL["attention_fp64_vs_plain"])
        grad = torch.randn_like(ref)
        leaves = (q, k, v, module.sinks)
        for got, want in zip(torch.autograd.grad(fast[0], leaves, grad), torch.autograd.grad(ref, leaves, grad)):
            torch.testing.assert_close(got, want, rtol=0, atol=TOL["attention_fp64_vs_plain"])
    assert len(graphs) == 1 and attention.graph_attention_backends(graphs[0]) == {"fa4"}
    assert [kind for kind, _ in stand_in.calls] == ["forward", "backward"] * 2
    torch._dynamo.reset()


def _sequences(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 131, (n,), generator=g) for n in (1, 9, 4, 13)]


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2"])  # sinks + alternating windows; softcap + window
def test_patch_option_runs_fa4_in_every_layer_and_checks_it(stand_in, model_type, monkeypatch):
    model = build_tiny_model(model_type)
    if model_type == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(1))
    layers = model.config.num_hidden_layers
    seqs = _sequences()
    ids, mask = right_padded(seqs)
    handle = ac.patch_model(model, attention_backend="fa4")
    decision = handle.plan["attention"]
    assert decision.value == "fa4" and decision.asked == {"attention_backend": "fa4"} and decision.explicit
    trace = Counter()
    with torch.no_grad():
        out = ac.compute_logprobs(model, ac.pack(seqs), trace=trace)
        ref_lp, ref_ent = reference_logprobs(model, ids, mask)
    assert trace["varlen_attention:fa4"] == layers and trace["attention:actorcore_packed"] == layers
    assert (out.log_probs - ref_lp).abs().max() <= TOL["packed_vs_hf_fp32"]
    assert (out.entropy - ref_ent).abs().max() <= TOL["packed_vs_hf_fp32"]

    import actorcore.hf.features.attention as attention

    kernel = attention.varlen_causal_attention
    monkeypatch.setattr(attention, "varlen_causal_attention",
                        lambda *args, **kwargs: kernel(*args, **{**kwargs, "backend": "segments"}))
    with pytest.raises(PackingNotAppliedError, match="attention_backend='fa4' ran 0 times"):
        ac.compute_logprobs(model, ac.pack(seqs))
    handle.revert()


def test_patch_option_is_validated_and_reported(caplog):
    model = build_tiny_model("qwen2")
    with pytest.raises(ValueError, match="attention_backend must be 'auto', 'fa4', 'flash_attn', 'torch_varlen' or "
                                         "'segments', got 'fa3'"):
        ac.patch_model(model, attention_backend="fa3")
    with pytest.raises(ValueError, match="attention_backend='fa4': FA4 runs on CUDA devices only"):
        ac.patch_model(model, attention_backend="fa4")
    assert not is_patched(model)
    with caplog.at_level("INFO", logger="actorcore.hf.patch"):
        handle = ac.patch_model(model)
    line = ("attention: 'segments' (attention_backend='auto', default): auto: flash kernels need CUDA and 16-bit "
            "inputs")
    assert handle.plan["attention"].line().startswith(line) and not handle.plan["attention"].explicit
    assert line in str(handle.plan) and line in caplog.text
    handle.revert()
    handle = ac.patch_model(model, attention_backend="segments")
    trace = Counter()
    ac.compute_logprobs(model, ac.pack(_sequences()), trace=trace)
    assert trace["varlen_attention:segments"] == model.config.num_hidden_layers
    handle.revert()
