"""The compiled decoder: each decoder layer's forward compiled by ``torch.compile``
(``patch_model(compiled_decoder=...)``).

Why: between the matmuls a decoder layer runs a dozen memory-bound kernels (RMSNorm in fp32 and its casts, the
residual adds, SwiGLU / GeGLU, RoPE, q/k norms, MoE routing and its copies); on the H200 they were 34% of the
actor step's kernel time (Qwen2.5-1.5B shape). Compiling the layer's own forward lets Inductor fuse them into a
few kernels, for every architecture, from the model's own code (no copied forward per family). Chosen by
measurement (``bench/fusion_candidates.py``) over Liger-Kernel's RMSNorm + SwiGLU and eager.

How: each decoder layer gets an instance ``forward`` (a ``CompiledLayerForward`` holding its layer) that runs one
``torch.compile(..., dynamic=True)`` of the layer class's original forward, shared by the layers of a class (one
compilation, symbolic token count: no recompilation per pack length). The packed attention is traced into the
layer's graph where its backend is torch's varlen op or FA4's op (``IN_GRAPH_KWARG``): Inductor then fuses the
q/k/v layouts and the residual stream's gradients around it. Other attention (Ulysses, flash-attn, sinks or softcap
outside FA4) stays out of the graph (``torch.compiler.disable``), as do instance forwards other patches install in a
layer (tiled MLP, recomputed norms). A layer runs compiled only in actorcore's own decoder calls, which pass
``COMPILED_KWARG``; any other call (the model's own forward, ``verify``'s reference, batch-invariant calls)
runs the original eager forward. Each compiled layer call counts under ``COMPILED_TRACE_KEY`` in the call's trace;
one in which no compiled graph ran (Dynamo ran the layer's Python: past its recompile limit, or a skipped frame)
counts under ``EAGER_FALLBACK_TRACE_KEY``, and the call is refused.

Checkpointed inside its graph: a compiled layer that a call fully checkpoints (``InGraphCheckpoint``, set by
``hf.features.checkpointing``) runs a second compilation, of its forward under torch's non-reentrant checkpoint with
every op marked to be recomputed, traced whole (``fullgraph``). AOTAutograd's partitioner then saves only the
layer's inputs and recomputes in the backward graph exactly what backward needs, fused with it: not the MLP's down
projection, whose output only feeds the residual sum (a quarter of a dense layer's forward FLOPs), which torch's
checkpoint around the compiled layer runs again. Each such call counts under ``CHECKPOINTED_IN_GRAPH_KEY``. Where the
layer's forward does not trace whole (a graph break: Ulysses, attention outside the graph), the class's layers take
torch's checkpoint around the compiled forward instead, with one warning, and count under
``CHECKPOINTED_AROUND_KEY``.

Where: CUDA, 16-bit weights, Triton present; elsewhere (CPU, fp32) nothing is installed and the path is the
eager one, unchanged. Within bf16 rounding of the eager layer, not bitwise (Inductor reduces in another order); as
far from the fp32 model as eager is (``bench/actor_step.py``). On by default (``"auto"``) where it was measured
faster side by side; the first call compiles (about 20-30 s on the H200), later packs of any length reuse it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint

from actorcore.errors import PatchNotAppliedError
from actorcore.hf.call import TRACE_KWARG, DecoderCall, parallel_from_kwargs
from actorcore.hf.features.attention import IN_GRAPH_KWARG, PACKED_ATTENTION, graph_attention_backends, trace_key
from actorcore.hf.features.base import DecoderFeature
from actorcore.hf.features.instance_forwards import install_forwards
from actorcore.hf.features.plan import STANDS_DOWN, Conflict, FeatureOption, PlanFacts, check_choice
from actorcore.kernels.compiled_graphs import VARIANTS_LIMIT, ReportingGraph, variant_room

logger = logging.getLogger(__name__)

COMPILED_KWARG = "actorcore_compiled"
COMPILED_TRACE_KEY = "compiled_decoder:layers"
EAGER_FALLBACK_TRACE_KEY = "compiled_decoder:ran_uncompiled"  # compiled layer calls in which no compiled graph ran
COMPILED_CHOICES = (True, False, "auto")
CHECKPOINT_KWARG = "actorcore_checkpoint_in_graph"  # passed by InGraphCheckpoint to the layer's instance forward
CHECKPOINTED_IN_GRAPH_KEY = "compiled_decoder:checkpointed_in_graph"  # compiled layer calls checkpointed in-graph
CHECKPOINTED_AROUND_KEY = "compiled_decoder:checkpointed_around_graph"  # ... by torch's checkpoint around the graph


def compile_refusal(model: torch.nn.Module) -> str | None:
    """Why this model cannot run the compiled decoder here (None: it can)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return "the model is not on a CUDA device (the compiled decoder compiles Triton kernels)"
    if param.dtype not in (torch.bfloat16, torch.float16):
        return (f"the model's weights are {param.dtype}; the compiled decoder is for bf16 / fp16 models (fp32 stays "
                "eager)")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def auto_compile_refusal(decided: Any) -> str | None:
    """Why ``"auto"`` (the default) leaves a model eager that could compile: the other options asked for (None:
    compile). ``"auto"`` compiles only the combinations measured side by side on the GPU (plain, with any
    checkpointing mode but ``"selective"``, with ``offload_activations="auto"``); ``True`` compiles the others too."""
    offload = decided["offload_activations"]
    others = [name for name, on in (("Ulysses SP", decided["parallel"].on),
                                    ("tiled MLP", decided["tiled_mlp_shards"].on),
                                    ("activation offload of fixed layers", offload.on and offload.value != "auto"),
                                    ("recomputed norms", decided["recompute_norms"].on)) if on]
    if others:
        return (f"the compiled decoder with {' and '.join(others)} has not been measured on the GPU "
                "(compiled_decoder=True compiles it anyway)")
    return None


def _selective(mine: Any, checkpointing: Any, decided: Any, facts: Any) -> bool:
    return mine.on and checkpointing.value is not None and checkpointing.value.mode == "selective"


def _every_layer_offloaded_under_a_budget(mine: Any, offload: Any, decided: Any, facts: Any) -> bool:
    checkpointing = decided["checkpointing"].value
    return (mine.on and offload.value == len(facts.parts.layers) and checkpointing is not None
            and checkpointing.mode == "auto")


class CompiledDecoderOption(FeatureOption):
    """``compiled_decoder``: True, False or "auto"; its value: whether the attention layers (its targets) compile."""

    name = "compiled_decoder"
    keywords = {"compiled_decoder": "auto"}
    needs = ("parallel", "tiled_mlp_shards", "offload_activations", "recompute_norms", "checkpointing")
    conflicts = (
        Conflict("checkpointing", holds=_selective,
                 why="a compiled layer is not checkpointed selectively: its compiled graph keeps its own tensors "
                     "instead, so the compiled layers would not be checkpointed at all",
                 instead="checkpointing='auto' with memory_budget_gib (compiled layers kept as compiled, the others "
                         "fully checkpointed), checkpointing='full', or compiled_decoder=False"),
        Conflict("offload_activations", holds=_every_layer_offloaded_under_a_budget,
                 why="under checkpointing='auto' a compiled layer the budget keeps is kept whole (not checkpointed: no "
                     "input to offload), so offloading every layer would leave the budget nothing to keep",
                 instead="offload_activations='auto' (the layers the budget fully checkpoints), "
                         "offload_activations=K (the first K layers; the budget keeps among the others), "
                         "checkpointing='full', or compiled_decoder=False"),
    )
    doc = ("the attention decoder layers run their forward compiled by ``torch.compile`` in actorcore's calls (the "
           "elementwise work between the matmuls fused; within bf16 rounding of eager). ``'auto'`` (default): on a "
           "CUDA model with 16-bit weights and Triton, without SP, tiled MLP, offload of fixed layers or recomputed "
           "norms (not measured on the GPU; ``offload_activations='auto'`` is) and not with "
           "``checkpointing='selective'``, else eager; ``True`` refuses where it cannot run and compiles with the "
           "other options too; ``False`` keeps the eager forward.")

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        fused = asked["compiled_decoder"]
        check_choice("compiled_decoder", fused, COMPILED_CHOICES)
        if fused is False:
            return self.decision(asked, False, "not asked")
        refusal = compile_refusal(facts.model)
        if refusal is not None and fused is True:
            raise ValueError(f"compiled_decoder=True: {refusal}; pass compiled_decoder='auto' (eager where it "
                             "cannot run) "
                             "or False")
        if refusal is None and fused == "auto":
            refusal = auto_compile_refusal(decided)
        if refusal is not None:
            return self.decision(asked, False, f"auto: {refusal}")
        ids = {id(layer) for layer in facts.parts.attention_layers}
        layers = [i for i, layer in enumerate(facts.parts.layers) if id(layer) in ids]
        why = "a 16-bit CUDA model with Triton" + ("" if fused is True else ", a measured combination")
        return self.decision(asked, True, f"each attention layer's forward compiled ({why})", layers)


@functools.cache
def _checkpoint_wrapper_code() -> Any:
    """The code object of transformers' checkpointing ``forward`` wrapper (transformers >= 5.24 checkpoints inside
    ``forward``; older ones inside ``__call__``: None)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if "__call__" in GradientCheckpointingLayer.__dict__:
        return None

    class _Probe(GradientCheckpointingLayer):
        def forward(self) -> None:
            return None

    return _Probe.forward.__code__


def original_forward(layer_class: type) -> Callable:
    """The layer class's forward without transformers' checkpointing wrapper."""
    forward, wrapper = layer_class.forward, _checkpoint_wrapper_code()
    while wrapper is not None and getattr(forward, "__code__", None) is wrapper:
        forward = forward.__wrapped__
    return forward


class CompiledLayer:
    """``torch.compile`` of one layer class's forward (Inductor, symbolic token count), shared by all its layers
    (they are its first argument) and by every model of the class in the process: one compilation. Its backend
    notes which attention backends' ops each captured graph calls (``graph_attention_backends``) and makes each
    graph, when it runs, say so to the layer call it runs in (``GraphRuns``: that a graph ran, and the attention it
    held): a layer whose attention was traced into
    its graph cannot count that call itself, so the compiled layer counts it (and the backend) for the graph, from what
    ran in this call, never from what an earlier model or another backend request compiled. ``graphs`` /
    ``graphs_with_attention`` / ``attention_backends`` describe the captures (for tests and benchmarks; no check
    reads them).

    ``checkpointed``: the compilation of the forward under torch's non-reentrant checkpoint, traced whole
    (``in_graph_checkpointed``); ``refusal`` says why it could not be (set by the first failure, then the class's
    layers are checkpointed around the plain compilation: a property of the forward's code, like Dynamo's cache)."""

    def __init__(self, forward: Callable, checkpointed: bool = False) -> None:
        self.graphs = 0
        self.graphs_with_attention = 0
        self.attention_backends: set[str] = set()
        self.refusal: str | None = None
        fn = in_graph_checkpointed(forward) if checkpointed else forward
        self.fn = torch.compile(fn, dynamic=True, fullgraph=checkpointed, backend=self._inductor)

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        graphs = [module.graph for module in gm.modules() if isinstance(module, torch.fx.GraphModule)]
        backends = frozenset(backend for graph in graphs for backend in graph_attention_backends(graph))
        checkpointed = any(holds_checkpoint(graph) for graph in graphs)
        self.graphs += 1
        self.attention_backends |= backends
        self.graphs_with_attention += bool(backends)
        return ReportingGraph(compile_fx(gm, example_inputs), functools.partial(_graph_ran, backends, checkpointed))


def in_graph_checkpointed(forward: Callable) -> Callable:
    """``forward`` under torch's non-reentrant checkpoint, for ``torch.compile`` to trace as one graph (the checkpoint
    a higher-order op in it): AOTAutograd then recomputes in backward only what backward needs. Every op is marked
    to be recomputed (a selective checkpoint's policy): under plain checkpoint torch 2.11 left the ops inside an
    autograd.Function (quack's gated MLP) unmarked, and its partitioner kept their outputs (the ``[T, 2I]``
    pre-activation: 49 KB per token on the Qwen3-8B shape, measured on the H200)."""
    context = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, _recompute_every_op)

    def checkpointed(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, layer, *args, use_reentrant=False, context_fn=context,
                                                 **kwargs)

    return checkpointed


def _recompute_every_op(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE


def holds_checkpoint(graph: torch.fx.Graph) -> bool:
    """Whether a graph Dynamo captured holds a checkpointed region (torch's ``tag_activation_checkpoint``)."""
    return any(node.op == "call_function" and "tag_activation_checkpoint" in str(node.target)
               for node in graph.nodes)


class GraphRuns:
    """What the compiled graphs that ran in one compiled layer call held (set for the call by
    ``CompiledLayerForward``). ``graphs`` 0 after the call: Dynamo ran the layer's Python eagerly (past its recompile
    limit, or a frame it skipped), which the call must not pass off as compiled."""

    __slots__ = ("graphs", "with_attention", "backends", "checkpointed")

    def __init__(self) -> None:
        self.graphs = 0
        self.with_attention = 0
        self.checkpointed = 0  # graphs that ran the layer under a checkpoint inside them
        self.backends: set[str] = set()  # the attention backends whose ops those graphs called


# The compiled layer call a compiled graph runs in: set and reset around each call, so a graph reports to the call
# that ran it (a context variable, like torch's own grad mode, not a process-wide record).
_LAYER_CALL: contextvars.ContextVar[GraphRuns | None] = contextvars.ContextVar("actorcore_compiled_layer_call",
                                                                               default=None)


def _graph_ran(backends: frozenset[str], checkpointed: bool) -> None:
    """A compiled graph's run, noted in the layer call it runs in, with the packed attention's ``backends`` where
    the graph holds that attention (empty: it does not) and whether it checkpoints the layer inside it."""
    runs = _LAYER_CALL.get()
    if runs is not None:
        runs.graphs += 1
        runs.checkpointed += checkpointed
        if backends:
            runs.with_attention += 1
            runs.backends |= backends


@functools.cache
def compiled_forward(forward: Callable, checkpointed: bool = False) -> CompiledLayer:
    """One compilation per layer class's forward, and one of it checkpointed inside the graph (its graphs serve every
    model of the class and every attention backend request, which Dynamo guards on; what they report goes to the call
    that runs them)."""
    return CompiledLayer(forward, checkpointed)


def recompute_pointwise() -> contextlib.AbstractContextManager:
    """AOTAutograd's partitioner setting for the compiled layers: keep the matmul outputs, recompute the pointwise
    work in backward even where backward needs its result as a matmul operand.

    By default the partitioner saves such a result (``ban_recompute_materialized_backward``): SwiGLU's
    ``act(gate) * up`` (the down projection's weight-gradient operand) beside gate and up, and each RMSNorm's
    output beside its input, about a third of a dense layer's saved bytes. Recomputing them costs one fused
    pointwise pass in backward. Active while a compiled layer runs (where it compiles), so it holds for exactly
    these graphs; a torch without the setting compiles with its defaults.
    """
    config = torch._functorch.config
    if not hasattr(config, "ban_recompute_materialized_backward"):
        return contextlib.nullcontext()
    return config.patch(ban_recompute_materialized_backward=False)


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """What the compiled layers are traced and run under: the partitioner recomputing pointwise work
    (``recompute_pointwise``), floats specialised (Dynamo's ``specialize_float``): a layer's float attributes
    (norm eps, attention scale, dropout) are constants of its graph, guarded, rather than graph inputs, so the
    attention traced into the graph hands torch's varlen op its scale as a number; Python side effects allowed in
    a checkpointed region (``skip_fwd_side_effects_in_bwd_under_checkpoint``: made in forward, not again in backward,
    where a compiled graph has no Python to run; the hub-kernel wrappers transformers puts on attention modules set
    and reset a context variable); and room for the graph variants (``kernels.compiled_graphs.variant_room``)."""
    dynamo = torch._dynamo.config
    settings = {name: True for name in ("specialize_float", "skip_fwd_side_effects_in_bwd_under_checkpoint")
                if hasattr(dynamo, name)}
    with recompute_pointwise(), dynamo.patch(**settings), variant_room():
        yield


class CompiledLayerForward:
    """The instance ``forward`` of a decoder layer: its compiled forward in actorcore's calls, else the eager one.

    Holds its layer (not a closure), so a deep copy of the model runs the copy's layer. Under transformers >= 5.24
    (checkpointing inside the class's ``forward``, which this instance forward replaces) it checkpoints as that
    wrapper would.
    """

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.forward = original_forward(type(layer))
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fused = bool(kwargs.pop(COMPILED_KWARG, False))
        layer = self.layer
        if (_checkpoint_wrapper_code() is not None and layer.gradient_checkpointing and layer.training
                and torch.is_grad_enabled()):
            return layer._gradient_checkpointing_func(functools.partial(self._run, fused, **kwargs), *args)
        return self._run(fused, *args, **kwargs)

    def _run(self, fused: bool, *args: Any, **kwargs: Any) -> Any:
        checkpoint = kwargs.pop(CHECKPOINT_KWARG, None)
        if checkpoint == "around":  # InGraphCheckpoint's fallback, under torch's checkpoint: count the forward once
            ref = kwargs.get(TRACE_KWARG)
            if ref is not None and torch._C._current_graph_task_id() == -1:
                ref.counts[CHECKPOINTED_AROUND_KEY] += 1
        if not fused:
            if checkpoint == "in_graph":
                raise _NotCheckpointedInGraph  # an eager layer in this call: InGraphCheckpoint checkpoints around it
            return self.forward(self.layer, *args, **kwargs)
        if checkpoint != "in_graph":
            return self._compiled(compiled_forward(self.forward), args, kwargs)
        checkpointed = compiled_forward(self.forward, checkpointed=True)
        try:
            return self._compiled(checkpointed, args, kwargs)
        except Exception as error:
            if not isinstance(error, _trace_failures()):
                raise
            self._uncount(kwargs)
            checkpointed.refusal = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            logger.warning("the compiled %s cannot be checkpointed inside its graph (%s); its fully checkpointed calls "
                           "run torch's checkpoint around the compiled layer instead, whose recompute redoes the whole "
                           "forward", type(self.layer).__name__, checkpointed.refusal)
            raise _NotCheckpointedInGraph from error

    def _uncount(self, kwargs: dict) -> None:
        """Take back what ``_compiled`` counted before a compilation that raised while tracing."""
        self.calls -= 1
        ref = kwargs.get(TRACE_KWARG)
        if ref is not None:
            ref.counts[COMPILED_TRACE_KEY] -= 1

    def _compiled(self, compiled: CompiledLayer, args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        ref = kwargs.get(TRACE_KWARG)
        if ref is not None:  # before the call: a checkpoint's recompute may stop inside it
            ref.counts[COMPILED_TRACE_KEY] += 1
        runs = GraphRuns()
        token = _LAYER_CALL.set(runs)
        try:
            with compile_settings():
                out = compiled.fn(self.layer, *args, **kwargs, **{IN_GRAPH_KWARG: True})
        finally:
            _LAYER_CALL.reset(token)
        if ref is not None and not runs.graphs:
            ref.counts[EAGER_FALLBACK_TRACE_KEY] += 1
        if ref is not None and runs.checkpointed:
            ref.counts[CHECKPOINTED_IN_GRAPH_KEY] += 1
        parallel = parallel_from_kwargs(kwargs)
        if ref is not None and runs.with_attention and (parallel is None or parallel.sp_size == 1):
            ref.counts[trace_key(PACKED_ATTENTION)] += 1  # its graph ran the attention; Ulysses counts itself
            for backend in runs.backends:
                ref.counts[f"varlen_attention:{backend}"] += 1
        return out


def _trace_failures() -> tuple[type, ...]:
    """What torch.compile raises, while tracing and before the graph runs anything, where a forward does not trace
    as one graph: a graph break under ``fullgraph``, a failed backend, the recompile limit reached."""
    exc = torch._dynamo.exc
    return (exc.TorchDynamoException, getattr(exc, "FailOnRecompileLimitHit", exc.TorchDynamoException))


class _NotCheckpointedInGraph(Exception):
    """Raised by a compiled layer asked to checkpoint inside its graph where it cannot (before it ran anything)."""


def in_graph_refusal(layer: torch.nn.Module) -> str | None:
    """Why ``layer``'s class cannot be checkpointed inside its compiled graph, as far as known (None: not known)."""
    return compiled_forward(original_forward(type(layer)), checkpointed=True).refusal


class InGraphCheckpoint:
    """A compiled layer's ``_gradient_checkpointing_func`` for a call that fully checkpoints it. Called as torch's
    checkpoint is (``func(fn, *args)``, ``fn`` the layer's call with its keyword arguments bound, maybe wrapped by
    ``base.switched_for_call``), it runs the layer asking its instance forward (``CompiledLayerForward``) to checkpoint
    inside its compiled graph; where the layer's class cannot (``in_graph_refusal``, or found on this call), torch's
    non-reentrant checkpoint around ``fn``, whose recompute runs ``fn`` again. Without gradients, the plain call."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer

    def __call__(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if in_graph_refusal(self.layer) is None:
            try:
                return fn(*args, **kwargs, **{CHECKPOINT_KWARG: "in_graph"})
            except _NotCheckpointedInGraph:
                pass  # logged where it was found; nothing ran
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs,
                                                 **{CHECKPOINT_KWARG: "around"})

    def __repr__(self) -> str:
        return f"InGraphCheckpoint({type(self.layer).__name__})"


def install_compiled_layers(layers: list[torch.nn.Module]) -> tuple[list[CompiledLayerForward], Callable[[], None]]:
    """Install a ``CompiledLayerForward`` on each layer; returns them and the undo."""

    def make(layer: torch.nn.Module, previous: Callable | None) -> CompiledLayerForward:
        if previous is not None:
            raise ValueError(f"{type(layer).__name__} already has an instance forward ({previous!r}); the compiled "
                             "decoder compiles the class's own forward: revert the other patch first")
        return CompiledLayerForward(layer)

    return install_forwards(layers, make)


class CompiledDecoder(DecoderFeature):
    """``patch_model(compiled_decoder=...)``: the compiled forwards for the patch's lifetime (on the layers its
    decision targets); every call passes ``COMPILED_KWARG`` (a batch-invariant call stands it down: the eager
    forward), and ``check`` requires each compiled layer to have run compiled."""

    name = "compiled_decoder"
    options = (CompiledDecoderOption(),)

    def in_batch_invariant_call(self, decided: Any) -> str:
        return STANDS_DOWN

    def install(self, handle: Any) -> None:
        fused = handle.state.targets("compiled_decoder")
        if fused:
            _, restore = install_compiled_layers([handle.parts.layers[i] for i in fused])
            handle.add_undo(restore)

    def active(self, call: DecoderCall) -> bool:
        return (call.patch is not None and bool(call.patch.targets("compiled_decoder"))
                and self.name not in call.standing_down)

    def enter(self, call: DecoderCall) -> Any:
        call.kwargs[COMPILED_KWARG] = True
        return contextlib.nullcontext()

    def check(self, call: DecoderCall) -> None:
        ran, layers = call.ran(COMPILED_TRACE_KEY), len(call.patch.targets("compiled_decoder"))
        if ran < layers:
            raise PatchNotAppliedError(
                f"the compiled decoder ran in {ran} of {layers} decoder layers of {call.model_name}: the installed "
                "transformers bypassed the layers' instance forward; refusing to continue unfused")
        uncompiled = call.ran(EAGER_FALLBACK_TRACE_KEY)
        if uncompiled:
            raise PatchNotAppliedError(
                f"{uncompiled} compiled decoder layer calls of {call.model_name} ran no compiled graph: torch.compile "
                "ran them uncompiled (past torch._dynamo.config.recompile_limit, here at least "
                f"{VARIANTS_LIMIT} variants of one layer class, or a frame Dynamo skipped; its log says "
                "which); refusing to continue unfused. Raise the limit, or pass compiled_decoder=False")


def compiled_layers(call: DecoderCall) -> frozenset[int]:
    """The decoder layers that run compiled in this call (none where the compiled decoder is off or stands down)."""
    if not CompiledDecoder().active(call):
        return frozenset()
    return frozenset(call.patch.targets("compiled_decoder"))
