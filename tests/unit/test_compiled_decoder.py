"""The compiled decoder's mechanics (``patch_model(compiled_decoder=True)``), run on the CPU with Inductor's C++ kernels in
fp32 (the product enables it only on CUDA for 16-bit models; this test lifts that refusal): per token and per
gradient element against the eager packed path, with layer checkpointing (transformers >= 5.24 checkpoints inside
the class's forward, which the instance forward takes over) and with ``checkpointing="auto"`` keeping every layer
(compiled layers kept as compiled, saving gate and up but not their SwiGLU product); the trace proves the compiled layers ran; a
pack of another length compiles nothing new; the model's own forward stays eager; a deep copy runs its own layers;
``revert`` restores the layers; bypassed layers raise."""

from __future__ import annotations

import copy
import functools
import logging
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from support.decoder_steps import seeded_batch, train_step

import actorcore as ac
import actorcore.hf.features.compiled_decoder as compiled_decoder
import actorcore.kernels.compiled_graphs as compiled_graphs
from actorcore.hf.features.checkpointing import UNCHECKPOINTED_LAYERS
from actorcore.errors import PatchNotAppliedError
from actorcore.hf.features.compiled_decoder import COMPILED_TRACE_KEY, CompiledLayerForward
from actorcore.testing.tiny_configs import build_tiny_model, checkpointed
from actorcore.testing.tolerances import TOL


TOL_FP32 = dict(rtol=0.0, atol=TOL["compiled_decoder_vs_eager_fp32"])


def _close(eager, fused):
    (lp_e, ent_e, g_e), (lp_f, ent_f, g_f) = eager, fused
    tol = TOL["compiled_decoder_vs_eager_fp32"]
    assert (lp_e - lp_f).abs().max().item() < tol and (ent_e - ent_f).abs().max().item() < tol
    assert g_e.keys() == g_f.keys()
    for name in g_e:
        scale = g_e[name].abs().max().item()
        assert (g_e[name] - g_f[name]).abs().max().item() <= TOL["grad_compiled_decoder_vs_eager_fp32_rel"] * scale, name


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_compiled_layers_on_the_cpu(monkeypatch):
    monkeypatch.setattr(compiled_decoder, "compile_refusal", lambda model: None)
    model = checkpointed(build_tiny_model("llama", seed=3))
    layers = model.config.num_hidden_layers
    batch = seeded_batch()
    handle = ac.patch_model(model)
    eager = train_step(model, batch, Counter())
    handle.revert()
    model.zero_grad(set_to_none=True)

    handle = ac.patch_model(model, compiled_decoder=True)
    forwards = [layer.forward for layer in model.model.layers]
    assert all(isinstance(f, CompiledLayerForward) for f in forwards)
    trace = Counter()
    fused = train_step(model, batch, trace)
    _close(eager, fused)
    assert trace[COMPILED_TRACE_KEY] == 2 * layers  # each layer's forward and its recompute in backward
    graphs = _graphs()
    g = torch.Generator().manual_seed(9)
    model.zero_grad(set_to_none=True)
    train_step(model, ac.pack([torch.randint(3, 131, (n,), generator=g) for n in (5, 40, 12)]), Counter())
    assert _graphs() == graphs, "a pack of another length compiled again"
    calls = sum(f.calls for f in forwards)
    with torch.no_grad():
        model(input_ids=batch.input_ids[None])  # the model's own forward: eager
    assert sum(f.calls for f in forwards) == calls
    twin = copy.deepcopy(model)
    assert all(layer.forward.layer is layer for layer in twin.model.layers)
    handle.revert()
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)

    model.zero_grad(set_to_none=True)
    handle = ac.patch_model(model, compiled_decoder=True, checkpointing="auto", memory_budget_gib=1e6)  # all kept
    trace, saved = Counter(), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        _close(eager, train_step(model, batch, trace))
    assert trace[UNCHECKPOINTED_LAYERS] == layers and trace[COMPILED_TRACE_KEY] == layers  # no recompute
    # The partitioner keeps gate and up, and recomputes act(gate) * up for the down projection's weight gradient.
    inner = [s for s in saved if s.numel() == batch.num_tokens * model.config.intermediate_size]
    assert len(inner) == 2 * layers, inner
    handle.revert()


def _matmul_flops(fn) -> tuple[float, object]:
    """``(FLOPs of the aten matmuls that ran in fn(), its result)``: the compiled graphs' extern GEMMs included (and a
    compilation's own, so compile first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn()
    flops = 0.0
    for event in prof.events():
        shapes = event.input_shapes
        if event.name in ("aten::mm", "aten::bmm"):
            a, b = shapes[0], shapes[1]
        elif event.name in ("aten::addmm", "aten::baddbmm"):
            a, b = shapes[1], shapes[2]
        else:
            continue
        assert a and b, f"a matmul of unknown shapes: {event.name}"
        flops += 2.0 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)
    return flops, result


class MLPLayer(torch.nn.Module):
    """Stands for a dense decoder layer in the in-graph checkpoint's test: a residual around RMSNorm and a SwiGLU
    MLP (the CPU has no attention a compiled graph can hold)."""

    def __init__(self, d: int = 24, inner: int = 56):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.gate, self.up = torch.nn.Linear(d, inner, bias=False), torch.nn.Linear(d, inner, bias=False)
        self.down = torch.nn.Linear(inner, d, bias=False)
        self.gradient_checkpointing = False

    def forward(self, hidden, **kwargs):
        h = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return hidden + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


@pytest.mark.slow
def test_full_checkpoint_runs_inside_the_compiled_graph():
    """A compiled layer under ``InGraphCheckpoint`` compiles its forward under torch's checkpoint: its backward graph
    recomputes what backward needs and not the MLP's down projection, whose output only feeds the residual sum.
    Output and every gradient element against the eager layer; the trace counts one compiled call checkpointed in its
    graph and no second call; the layer saves its input and weights, no ``[T, I]`` tensor; under activation offload
    only the input moves. By the matmul FLOPs that ran: torch's checkpoint around the compiled layer (the fallback)
    redoes exactly one down projection more."""
    from actorcore.hf.call import TRACE_KWARG, TraceRef
    from actorcore.hf.features.offload import OFFLOAD_BYTES, OFFLOAD_TENSORS, ActivationOffloader, OffloadedCheckpoint

    layer = MLPLayer()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 24, generator=g, requires_grad=True)
    grad_out = torch.randn(37, 24, generator=g)

    def step(fn, profiled=True):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        saved = []

        def run():
            out = fn()
            out.backward(grad_out)
            return out.detach()

        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            flops, out = _matmul_flops(run) if profiled else (None, run())
        return out, [x.grad] + [p.grad for p in layer.parameters()], saved, flops

    reference, ref_grads, _, _ = step(lambda: layer(x), profiled=False)
    compiled_decoder.compiled_forward.cache_clear()

    def checkpointed(trace, offloaded):
        kwargs = {compiled_decoder.COMPILED_KWARG: True, TRACE_KWARG: TraceRef(trace)}
        checkpoint = compiled_decoder.InGraphCheckpoint(layer)
        if offloaded:  # as activation offload wraps it: the input moves, the weights it saves beside it do not
            checkpoint = OffloadedCheckpoint(checkpoint, ActivationOffloader(trace), offload=True)
        return checkpoint(functools.partial(CompiledLayerForward(layer), **kwargs), x)

    results = {}
    for way in ("in_graph", "offloaded", "around"):
        trace = Counter()
        if way == "around":  # as where the layer's forward does not trace whole
            compiled_decoder.compiled_forward(MLPLayer.forward, checkpointed=True).refusal = "test"
        offloaded = way == "offloaded"
        step(lambda: checkpointed(Counter(), offloaded), profiled=False)  # compiles: the profile sees the run alone
        out, grads, saved, flops = step(lambda: checkpointed(trace, offloaded))
        torch.testing.assert_close(out, reference, **TOL_FP32)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, **TOL_FP32)
        results[way] = trace, saved, flops
    compiled_decoder.compiled_forward.cache_clear()

    (trace, saved, in_graph_flops), (around, _, around_flops) = results["in_graph"], results["around"]
    offloaded = results["offloaded"][0]
    assert offloaded[compiled_decoder.CHECKPOINTED_IN_GRAPH_KEY] == 1
    assert offloaded[OFFLOAD_TENSORS] == 1 and offloaded[OFFLOAD_BYTES] == x.numel() * x.element_size(), offloaded
    assert trace[compiled_decoder.CHECKPOINTED_IN_GRAPH_KEY] == 1 and trace[COMPILED_TRACE_KEY] == 1
    assert not trace[compiled_decoder.CHECKPOINTED_AROUND_KEY]
    assert (37, 24) in saved and not [s for s in saved if s.numel() == 37 * 56], saved
    assert around[compiled_decoder.CHECKPOINTED_AROUND_KEY] == 1 and around[COMPILED_TRACE_KEY] == 2  # and recompute
    assert not around[compiled_decoder.CHECKPOINTED_IN_GRAPH_KEY]
    assert around_flops - in_graph_flops == 2.0 * 37 * 56 * 24, (around_flops, in_graph_flops)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3", "glm4_moe", "qwen3_moe"])
def test_a_transformers_layer_checkpoints_inside_its_graph(model_type):
    """A transformers decoder layer (Qwen3, q/k norms, its own SDPA attention; the MoE layer of glm4_moe, with its
    grouped routing and shared expert, and of qwen3_moe, on the model's own grouped experts) under
    ``InGraphCheckpoint`` traces whole: the hub-kernel wrappers newer transformers put on attention modules set and
    reset a context variable in forward, a side effect the compiled checkpoint is told to make once. Output and
    gradients as the eager layer's."""
    from actorcore.hf.call import TRACE_KWARG, TraceRef

    model = build_tiny_model(model_type, seed=2, attn_implementation="sdpa").train()
    moe = [layer for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert bool(moe) == (model_type != "qwen3")
    layer = (moe or model.model.layers)[0]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 21, model.config.hidden_size, generator=g, requires_grad=True)
    position_ids = torch.arange(21)[None]
    plain = dict(position_embeddings=model.model.rotary_emb(x, position_ids), attention_mask=None,
                 position_ids=position_ids)

    def grads(out):
        out = out[0] if isinstance(out, tuple) else out
        model.zero_grad(set_to_none=True)
        x.grad = None
        out.backward(torch.ones_like(out))
        return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]

    want = grads(layer(x, **plain))
    trace = Counter()
    compiled_decoder.compiled_forward.cache_clear()
    try:
        kwargs = dict(plain, **{compiled_decoder.COMPILED_KWARG: True, TRACE_KWARG: TraceRef(trace)})
        got = grads(compiled_decoder.InGraphCheckpoint(layer)(functools.partial(CompiledLayerForward(layer), **kwargs),
                                                              x))
        assert compiled_decoder.in_graph_refusal(layer) is None
    finally:
        compiled_decoder.compiled_forward.cache_clear()
    assert trace[compiled_decoder.CHECKPOINTED_IN_GRAPH_KEY] == 1, dict(trace)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL_FP32)


@pytest.mark.slow
def test_full_checkpoint_of_a_layer_that_does_not_trace_whole(monkeypatch, caplog):
    """``checkpointing="full"`` on compiled layers whose forward does not trace as one graph (on the CPU the packed
    attention leaves the graph): the first call finds it, warns once and checkpoints those layers with torch's
    checkpoint around the compiled layer, under the call's attention switch in the recompute too; per token and
    gradient element as the eager path; the trace counts each layer checkpointed around its graph, and the plan's
    check holds; bypassed, the call raises."""
    monkeypatch.setattr(compiled_decoder, "compile_refusal", lambda model: None)
    model = build_tiny_model("llama", seed=3).train()
    layers, batch = model.config.num_hidden_layers, seeded_batch()
    handle = ac.patch_model(model)
    eager = train_step(model, batch, Counter())
    handle.revert()
    compiled_decoder.compiled_forward.cache_clear()
    try:
        for call in range(2):
            model.zero_grad(set_to_none=True)
            handle = ac.patch_model(model, compiled_decoder=True, checkpointing="full")
            trace = Counter()
            with caplog.at_level(logging.WARNING, logger=compiled_decoder.__name__):
                _close(eager, train_step(model, batch, trace))
            handle.revert()
            assert trace[compiled_decoder.CHECKPOINTED_AROUND_KEY] == layers
            assert not trace[compiled_decoder.CHECKPOINTED_IN_GRAPH_KEY]
            assert trace[COMPILED_TRACE_KEY] == 2 * layers  # the forward and torch's recompute of it
        assert caplog.text.count("cannot be checkpointed inside its graph") == 1, caplog.text
        assert compiled_decoder.in_graph_refusal(model.model.layers[0]) is not None
        # Negative control: layers whose checkpoint function is bypassed (run plainly) make the call raise.
        monkeypatch.setattr(compiled_decoder.InGraphCheckpoint, "__call__", lambda self, fn, *args, **kwargs:
                            fn(*args, **kwargs))
        handle = ac.patch_model(model, compiled_decoder=True, checkpointing="full")
        with pytest.raises(PatchNotAppliedError, match="fully checkpointed compiled decoder layers .* ran without a "
                                                       "checkpoint"):
            ac.compute_logprobs(model, batch)
        handle.revert()
    finally:
        compiled_decoder.compiled_forward.cache_clear()


def test_bypassed_compiled_layers_are_an_error(monkeypatch):
    """Negative control: layers that run their plain forward (as a transformers that bypassed the instance forward
    would) make the call raise instead of returning unfused results."""
    monkeypatch.setattr(compiled_decoder, "compile_refusal", lambda model: None)
    model = build_tiny_model("llama", seed=4).train()
    handle = ac.patch_model(model, compiled_decoder=True)
    for layer in model.model.layers:
        plain = compiled_decoder.original_forward(type(layer)).__get__(layer)
        layer.__dict__["forward"] = lambda *args, _plain=plain, **kwargs: _plain(
            *args, **{k: v for k, v in kwargs.items() if k != compiled_decoder.COMPILED_KWARG})
    with pytest.raises(PatchNotAppliedError, match="compiled decoder ran in 0 of"):
        ac.compute_logprobs(model, seeded_batch())
    handle.revert()


def test_auto_is_the_default_and_compiles_only_measured_combinations(monkeypatch):
    """``patch_model`` compiles by default where the compiled decoder can run and was measured (no SP, tiled MLP, offload or
    recomputed norms); with one of those ``"auto"`` stays eager and the plan says why (and that the options that
    follow the compiled decoder stay off with it), ``True`` compiles anyway; on the CPU the default installs nothing (the
    path stays the eager one)."""
    model = checkpointed(build_tiny_model("llama", seed=5))
    handle = ac.patch_model(model)  # the CPU: nothing compiled
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)
    handle.revert()

    monkeypatch.setattr(compiled_decoder, "compile_refusal", lambda model: None)
    handle = ac.patch_model(model)
    assert all(isinstance(layer.forward, CompiledLayerForward) for layer in model.model.layers)
    handle.revert()
    for kwargs, what in (({"recompute_norms": True}, "recomputed norms"),
                         ({"offload_activations": True}, "activation offload")):
        handle = ac.patch_model(model, **kwargs)
        assert not any(isinstance(layer.__dict__.get("forward"), CompiledLayerForward) for layer in model.model.layers)
        why = handle.plan["compiled_decoder"].why
        assert what in why and "compiled_decoder=True compiles it anyway" in why
        assert "the decoder is not compiled" in handle.plan["swiglu_mlp"].why
        handle.revert()
        handle = ac.patch_model(model, compiled_decoder=True, **kwargs)
        assert all(isinstance(layer.forward, CompiledLayerForward) for layer in model.model.layers)
        handle.revert()
    handle = ac.patch_model(model, tiled_mlp_shards=2)
    assert "compiled decoder with tiled MLP has not been measured" in handle.plan["compiled_decoder"].why
    handle.revert()


def test_packed_attention_traces_into_a_compiled_layer_only_when_asked(monkeypatch):
    """The packed attention inside a layer the compiled decoder compiles (``IN_GRAPH_KWARG``, traced under its settings
    with a symbolic token count) is traced into the layer's one graph: torch's varlen op, its scale a number (the
    module's float attributes specialised). Without that keyword (a user's own ``torch.compile``), or where the
    backend is not traceable, it leaves the graph, so it still counts itself. The CPU has no varlen kernel: the
    backend is declared traceable here and the graph is captured, not run."""
    import actorcore.hf.features.attention as attention

    from actorcore.kernels.attention.varlen import VARLEN_OP_NAME

    monkeypatch.setattr(attention, "traceable_backend", torch.compiler.assume_constant_result(
        lambda device_type, dtype, *request: "torch_varlen"))
    graphs = []

    class Captured(Exception):
        pass

    def capture(gm, example_inputs):
        graphs.append(gm.graph)
        raise Captured

    class Attention(torch.nn.Module):  # calls the interface function as transformers' attention modules do
        def __init__(self):
            super().__init__()
            self.scaling, self.attention_dropout = 0.3, 0.0

        def forward(self, q, k, v, **kwargs):
            out, _ = attention.packed_attention_forward(
                self, q, k, v, None, scaling=self.scaling, dropout=self.attention_dropout if self.training else 0.0,
                **kwargs)
            return out * 2

    module = Attention().train()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 10, 8, generator=g) for heads in (4, 2, 2))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    packing = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)

    def compiled_call(**flag):
        torch._dynamo.reset()
        with compiled_decoder.compile_settings():
            torch.compile(module, fullgraph=True, dynamic=True, backend=capture)(q, k, v, **packing, **flag)

    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="Captured"):
        compiled_call(**{attention.IN_GRAPH_KWARG: True})
    assert len(graphs) == 1 and attention.holds_packed_attention(graphs[0])
    (varlen,) = [n for n in graphs[0].nodes if VARLEN_OP_NAME in str(n.target)]
    assert 0.3 in varlen.args, varlen.args  # the scale as a number, not a graph input
    with pytest.raises(torch._dynamo.exc.Unsupported):  # fullgraph refuses the break around the eager attention
        compiled_call()
    monkeypatch.setattr(attention, "traceable_backend", torch.compiler.assume_constant_result(
        lambda device_type, dtype, *request: ""))  # no varlen kernel here
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled_call(**{attention.IN_GRAPH_KWARG: True})
    module.attention_dropout = 0.1  # dropout in training: not the traced path either
    monkeypatch.setattr(attention, "traceable_backend", torch.compiler.assume_constant_result(
        lambda device_type, dtype, *request: "torch_varlen"))
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled_call(**{attention.IN_GRAPH_KWARG: True})
    assert len(graphs) == 1
    torch._dynamo.reset()


class TinyLayer(torch.nn.Module):
    """Stands for a decoder layer in the compiled forward's own tests: ``relu(x * 0.5) + 1``."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((4,), 0.5))
        self.gradient_checkpointing = False

    def forward(self, hidden, **kwargs):
        return torch.relu(hidden * self.weight) + 1


def test_compiled_graphs_report_attention_to_the_call_that_ran_them(monkeypatch):
    """The compiled forward of a layer class is shared by every model of the class (one compilation), but whether
    a call's compiled graph ran the packed attention comes from that call: a reference model's graph that held the
    attention does not make an actor's later call (another graph of the same forward: gradients on) count an
    attention it did not run. Here a tiny layer class stands for a decoder layer and which captured graphs "hold
    the attention" is set by hand."""
    from actorcore.hf.call import TRACE_KWARG, TraceRef
    from actorcore.hf.features.attention import PACKED_ATTENTION, trace_key

    holding = {"attention": True}
    monkeypatch.setattr(compiled_decoder, "graph_attention_backends",
                        lambda graph: {"torch_varlen"} if holding["attention"] else set())
    reference, actor = TinyLayer(), TinyLayer()
    x = torch.randn(3, 4)

    def call(layer):
        trace = Counter()
        out = CompiledLayerForward(layer)(x, **{compiled_decoder.COMPILED_KWARG: True, TRACE_KWARG: TraceRef(trace)})
        assert trace["varlen_attention:torch_varlen"] == trace[trace_key(PACKED_ATTENTION)]  # the graph's backend
        return out, trace[trace_key(PACKED_ATTENTION)]

    torch._dynamo.reset()
    with torch.no_grad():
        out, attention = call(reference)  # its graph (no gradients) holds the attention
    assert attention == 1 and torch.equal(out, torch.relu(x * 0.5) + 1)
    holding["attention"] = False
    out, attention = call(actor)  # gradients on: another graph of the same compiled forward, without it
    assert attention == 0, "a graph compiled for another model's call made this call count the attention"
    out.sum().backward()
    assert torch.equal(actor.weight.grad, (x * (x * 0.5 > 0)).sum(0))
    with torch.no_grad():
        assert call(reference)[1] == 1  # the first graph again: it still reports to the call that runs it
    torch._dynamo.reset()


def test_a_layer_dynamo_runs_uncompiled_is_counted_and_refused(monkeypatch):
    """Past Dynamo's recompile limit torch.compile runs a frame's Python eagerly with only a log line. A compiled
    layer call in which no compiled graph ran counts under ``EAGER_FALLBACK_TRACE_KEY``: here the variants' room
    (``kernels.compiled_graphs.VARIANTS_LIMIT``) is one graph, so the second variant (gradients off) runs uncompiled and is
    counted; with the room of two it compiles and is not. Then a patched model whose compiled forwards run no graph
    is refused."""
    from actorcore.hf.call import TRACE_KWARG, TraceRef

    x = torch.randn(3, 4)

    def uncompiled_calls(layer: TinyLayer, grad: bool) -> int:
        trace = Counter()
        with torch.set_grad_enabled(grad):
            out = CompiledLayerForward(layer)(x, **{compiled_decoder.COMPILED_KWARG: True, TRACE_KWARG: TraceRef(trace)})
        assert torch.equal(out, torch.relu(x * 0.5) + 1) and trace[COMPILED_TRACE_KEY] == 1
        return trace[compiled_decoder.EAGER_FALLBACK_TRACE_KEY]

    for room, fallbacks in ((1, 1), (2, 0)):
        monkeypatch.setattr(compiled_graphs, "VARIANTS_LIMIT", room)
        torch._dynamo.reset()
        compiled_decoder.compiled_forward.cache_clear()
        with torch._dynamo.config.patch(recompile_limit=1):  # a config module: monkeypatch would delete it after
            assert uncompiled_calls(TinyLayer(), grad=True) == 0  # the first graph
            assert uncompiled_calls(TinyLayer(), grad=False) == fallbacks  # a second variant: only with room for it
    torch._dynamo.reset()
    compiled_decoder.compiled_forward.cache_clear()

    monkeypatch.setattr(compiled_decoder, "compile_refusal", lambda model: None)
    monkeypatch.setattr(compiled_decoder, "compiled_forward", lambda forward: SimpleNamespace(fn=forward))
    model = build_tiny_model("llama", seed=4).train()
    handle = ac.patch_model(model, compiled_decoder=True)
    with pytest.raises(PatchNotAppliedError, match=r"calls of .* ran no compiled graph: torch.compile ran them "):
        ac.compute_logprobs(model, seeded_batch())
    handle.revert()
