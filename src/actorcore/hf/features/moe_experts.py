"""The MoE experts path (``patch_model(moe_experts=...)``): each experts module runs grouped GEMMs over tokens
moved with gathers only.

Why: transformers' grouped experts forward (``grouped_mm_experts_forward``) moves tokens to their experts by
indexing (``hidden_states[perm // top_k]``, ``inv_perm[perm] = arange``, ``weighted_out[inv_perm]``), whose backward
is a scatter-add with duplicate indices in the model's dtype: atomics, nondeterministic, and, compiled in the
fused decoder, Inductor's slowest copy kernels of an MoE model's actor step. This path does the same math with the
gathers of ``kernels.moe_permute`` both ways (deterministic; each token's sum over its ``K`` experts in fp32,
rounded once), and the same grouped GEMMs (transformers' own ``_grouped_mm`` dispatcher: ``grouped_mm`` where
torch has it for the device and dtype, transformers' compile-safe per-expert fallback elsewhere), the model's own
gate activation (``_apply_gate`` / ``act_fn``), biases and post-expert norm. It traces under ``torch.compile``
without graph breaks, so the fused decoder compiles it into the layer.

How: each experts module of the MoE layers (transformers' standard experts class, the one its
``use_experts_implementation`` decorator makes) gets, for the patch's lifetime, an instance ``forward``: a
``SortedExpertsForward`` holding its module (a deep copy of the model runs the copy's experts) and the patch's trace
slot. It runs this path in actorcore's calls only; any other call (the model's own forward, ``verify``'s reference)
runs the module's own forward. A forward that ran sets its ``ran`` flag (a store, so a compiled layer replays it
without guarding on a count); the ``MoeExperts`` feature clears the flags before the decoder runs, counts the
modules that ran under ``MOE_EXPERTS_KEY`` and requires every installed module to have run.

Where (``"auto"``, the default): CUDA, bf16 / fp16 weights, transformers' standard experts class under one of
transformers' own implementations (``eager``, ``batched_mm``, ``grouped_mm``; a kernel chosen with
``set_experts_implementation``, such as ``deepgemm``, is kept); elsewhere the model's own experts code.
``"grouped"`` installs it on any device and dtype it runs in (float32 on the CPU too), refusing what it does not
cover; ``False`` keeps the model's own experts code. Expert parallelism (experts split over ranks, sentinel expert
ids) is refused.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator

import torch

from actorcore.archs import submodule
from actorcore.errors import PatchNotAppliedError
from actorcore.hf.call import DecoderCall, TraceRef
from actorcore.hf.features.base import DecoderFeature, patch_trace_bound
from actorcore.hf.features.instance_forwards import install_forwards
from actorcore.kernels.moe_permute import combine, expert_bias, permute, sort_by_expert

logger = logging.getLogger(__name__)

MOE_EXPERTS_KEY = "moe_experts:modules"
MOE_EXPERTS_CHOICES = ("auto", "grouped", False)
# transformers' own experts implementations, which "auto" replaces (any other was chosen on purpose: kept).
_GENERIC_IMPLEMENTATIONS = (None, "eager", "batched_mm", "grouped_mm")


@functools.cache
def _standard_experts_code() -> Any:
    """The code object of the ``forward`` that transformers' ``use_experts_implementation`` gives a class (None if
    this transformers has no such decorator)."""
    try:
        from transformers.integrations import use_experts_implementation
    except ImportError:
        return None

    class _Probe(torch.nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()

        def forward(self) -> None:
            return None

    return use_experts_implementation(_Probe).forward.__code__


def is_standard_experts(module: torch.nn.Module) -> bool:
    """Whether the module's class is one transformers' ``use_experts_implementation`` decorated (forward not
    overridden since)."""
    code = _standard_experts_code()
    return code is not None and getattr(type(module).forward, "__code__", None) is code


def _grouped_mm_dispatcher() -> Callable | None:
    """transformers' grouped GEMM dispatcher (``grouped_mm`` / ``_grouped_mm`` / its compile-safe fallback)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    return getattr(moe, "_grouped_mm", None)


def _expert_linear(grouped_mm: Callable, rows_SD: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   order: Any, transposed: bool) -> torch.Tensor:
    """Each sorted row through its expert's linear: ``weight`` is ``[E, out, in]`` (``[E, in, out]`` transposed)."""
    out = grouped_mm(rows_SD, weight if transposed else weight.transpose(-2, -1), order.offsets)
    return out if bias is None else out + expert_bias(bias, order)


def sorted_experts_forward(experts: torch.nn.Module, hidden_states_TD: torch.Tensor, top_k_index_TK: torch.Tensor,
                           top_k_weights_TK: torch.Tensor, grouped_mm: Callable) -> torch.Tensor:
    """transformers' experts math (``grouped_mm_experts_forward``) with the tokens moved by gathers both ways;
    ``grouped_mm(x, weight, offsets)``: transformers' grouped GEMM dispatcher."""
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError(f"{type(experts).__name__} is expert-parallel (experts split over ranks): actorcore's MoE "
                         "experts path does not handle its sentinel expert ids; patch with moe_experts=False")
    order = sort_by_expert(top_k_index_TK, experts.num_experts)
    rows = permute(hidden_states_TD, order)
    bias = None
    if experts.has_gate:
        weight = experts.gate_up_proj
        if experts.has_bias:
            bias = experts.gate_up_proj_bias
    else:
        weight = experts.up_proj
        if experts.has_bias:
            bias = experts.up_proj_bias
    rows = _expert_linear(grouped_mm, rows, weight, bias, order, experts.is_transposed)
    rows = experts._apply_gate(rows) if experts.has_gate else experts.act_fn(rows)
    down_bias = experts.down_proj_bias if experts.has_bias else None
    rows = _expert_linear(grouped_mm, rows, experts.down_proj, down_bias, order, experts.is_transposed)
    if getattr(experts, "has_post_expert_norm", False):
        rows = experts.post_expert_norm(rows)
    return combine(rows, top_k_weights_TK, order, hidden_states_TD.dtype)


class SortedExpertsForward:
    """The instance ``forward`` of an experts module: ``sorted_experts_forward`` in actorcore's calls, else the
    module's own forward. Holds its module (not a closure) and the patch's trace slot."""

    def __init__(self, experts: torch.nn.Module, trace: TraceRef, grouped_mm: Callable) -> None:
        self.experts = experts
        self.grouped_mm = grouped_mm  # transformers' grouped GEMM dispatcher
        self.trace = trace  # the patch's trace slot: the call's trace inside actorcore's calls, else None
        self.ran = False  # set by each run of the path; cleared by the feature before each call

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.trace.counts is None:
            return type(self.experts).forward(self.experts, hidden_states, top_k_index, top_k_weights)
        self.ran = True
        return sorted_experts_forward(self.experts, hidden_states, top_k_index, top_k_weights, self.grouped_mm)


def moe_experts_modules(parts: Any, spec: Any) -> list[tuple[str, torch.nn.Module]]:
    """``(name relative to the decoder, module)`` of the routed experts of each MoE layer: the modules of the
    layer's MLP (the spec's path) of transformers' standard experts class, or named ``...Experts`` (another
    experts class, e.g. a quantized one: found to be refused by name). Dense layers and shared experts have none."""
    if spec.mlp_kind != "moe":
        return []
    names = {id(module): name for name, module in parts.decoder.named_modules()}
    return [(names[id(module)], module) for layer in parts.layers for module in submodule(layer, spec.mlp).modules()
            if is_standard_experts(module) or type(module).__name__.endswith("Experts")]


def _module_refusal(module: torch.nn.Module) -> str | None:
    """Why this experts module cannot run the path (None: it can)."""
    name = type(module).__name__
    if _grouped_mm_dispatcher() is None:
        return "the installed transformers has no grouped GEMM dispatcher (transformers.integrations.moe._grouped_mm)"
    if not is_standard_experts(module):
        return (f"{name} is not transformers' standard experts class (use_experts_implementation): a quantized or "
                "custom experts module, whose math this path does not know")
    missing = [attr for attr in ("num_experts", "has_gate", "has_bias", "is_transposed") if not hasattr(module, attr)]
    if missing:
        return f"{name} lacks {', '.join(missing)} (an experts class of another transformers version)"
    if not (module.has_gate and callable(getattr(module, "_apply_gate", None))
            or not module.has_gate and callable(getattr(module, "act_fn", None))):
        return f"{name} has no gate function (_apply_gate) or activation (act_fn) for its layout"
    distributed = getattr(getattr(module, "config", None), "distributed_config", None)
    if getattr(module, "_is_expert_parallel", False) or getattr(distributed, "enable_expert_parallel", False):
        return f"{name} is expert-parallel (experts split over ranks, sentinel expert ids), which this path refuses"
    weight = module.gate_up_proj if module.has_gate else module.up_proj
    if weight.shape[0] != module.num_experts or module.down_proj.shape[0] != module.num_experts:
        return (f"{name} holds {weight.shape[0]} experts' weights for num_experts={module.num_experts} (experts "
                "split over ranks), which this path refuses")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{name}'s weights are {weight.dtype}; grouped_mm runs float32, bf16 and fp16"
    if "forward" in module.__dict__:
        return f"{name} already has an instance forward ({module.__dict__['forward']!r}): revert the other patch first"
    return None


def _auto_refusal(module: torch.nn.Module) -> str | None:
    """Why ``"auto"`` keeps this (coverable) module on its own code: where the path is not the measured case."""
    weight = module.down_proj
    if weight.device.type != "cuda":
        return "the model is not on a CUDA device"
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return f"its weights are {weight.dtype} (the path is for 16-bit models on the GPU)"
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation not in _GENERIC_IMPLEMENTATIONS:
        return f"the model's experts implementation is {implementation!r}, chosen on purpose"
    return None


def check_moe_experts_request(request: Any) -> None:
    if request not in MOE_EXPERTS_CHOICES or request is not False and not isinstance(request, str):
        raise ValueError(f"moe_experts must be 'auto', 'grouped' or False, got {request!r} ('grouped' installs "
                         "actorcore's experts path, False keeps the model's own experts code)")


def _model_refusal(model: torch.nn.Module, spec: Any, found: list[tuple[str, torch.nn.Module]]) -> str | None:
    """Why this model's experts cannot run the path (None: they can)."""
    name = type(model).__name__
    if spec.mlp_kind != "moe":
        return f"{spec.model_type} has no MoE layers (mlp_kind={spec.mlp_kind!r})"
    if getattr(model, "_tp_size", None) not in (None, 1):
        return (f"{name} is tensor-parallel through transformers' tp_plan (tp_size={model._tp_size}): its experts' "
                "weights are shards this path does not handle")
    if not found:
        return f"found no experts module (...Experts) in the MoE layers of {name}"
    return next((why for why in (_module_refusal(module) for _, module in found) if why is not None), None)


def moe_experts_names(model: torch.nn.Module, parts: Any, spec: Any, request: Any) -> tuple[str, ...]:
    """The experts modules (names relative to the decoder) to install the path on for ``patch_model(moe_experts=)``.
    ``"grouped"`` raises ``ValueError`` with the reason where it cannot; ``"auto"`` installs only where every MoE
    layer's experts can run it and ``_auto_refusal`` finds nothing."""
    check_moe_experts_request(request)
    if request is False:
        return ()
    found = moe_experts_modules(parts, spec)
    why = _model_refusal(model, spec, found)
    if why is not None:
        if request == "grouped":
            raise ValueError(f"moe_experts='grouped': {why}; pass moe_experts=False (or 'auto': the model's own "
                             "experts code where the path does not apply)")
        if spec.mlp_kind == "moe":
            logger.info("moe_experts='auto' keeps %s's own experts code: %s", type(model).__name__, why)
        return ()
    if request == "auto":
        why = _auto_refusal(found[0][1])
        if why is not None:
            logger.info("moe_experts='auto' keeps %s's own experts code: %s (moe_experts='grouped' installs the "
                        "path anyway)", type(model).__name__, why)
            return ()
    return tuple(name for name, _ in found)


class MoeExperts(DecoderFeature):
    """``patch_model(moe_experts=...)``: the experts' instance forwards for the patch's lifetime (on the modules named
    in the patch state); ``check`` requires each of them to have run in the call."""

    name = "moe_experts"

    def install(self, handle: Any) -> None:
        names = handle.state.moe_experts
        if names:
            trace, grouped_mm = handle.state.trace, _grouped_mm_dispatcher()
            modules = [handle.parts.decoder.get_submodule(name) for name in names]
            _, restore = install_forwards(modules, lambda module, _: SortedExpertsForward(module, trace, grouped_mm))
            handle.add_undo(restore)

    def active(self, call: DecoderCall) -> bool:
        return call.patch is not None and bool(call.patch.moe_experts)

    def enter(self, call: DecoderCall) -> Any:
        return self._counted(call)

    @contextlib.contextmanager
    def _counted(self, call: DecoderCall) -> Iterator[None]:
        forwards = [call.parts.decoder.get_submodule(name).__dict__.get("forward") for name in call.patch.moe_experts]
        forwards = [f for f in forwards if isinstance(f, SortedExpertsForward)]
        for forward in forwards:
            forward.ran = False
        with patch_trace_bound(call):
            yield
        call.trace[MOE_EXPERTS_KEY] += sum(forward.ran for forward in forwards)

    def check(self, call: DecoderCall) -> None:
        ran, modules = call.ran(MOE_EXPERTS_KEY), len(call.patch.moe_experts)
        if ran < modules:
            raise PatchNotAppliedError(
                f"actorcore's MoE experts path ran in {ran} of {modules} experts modules of {call.model_name}: the "
                "installed transformers bypassed their instance forward; refusing to continue on another path")
