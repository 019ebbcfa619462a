"""The MoE experts path (``patch_model(moe_experts=...)``): each experts module runs grouped GEMMs over tokens
moved with gathers only.

Why: transformers' grouped experts forward (``grouped_mm_experts_forward``) moves tokens to their experts by
indexing (``hidden_states[perm // top_k]``, ``inv_perm[perm] = arange``, ``weighted_out[inv_perm]``), whose backward
is a scatter-add with duplicate indices in the model's dtype: atomics, nondeterministic, and, compiled in the
compiled decoder, Inductor's slowest copy kernels of an MoE model's actor step. This path does the same math with the
gathers of ``kernels.moe_permute`` both ways (deterministic; each token's sum over its ``K`` experts in fp32,
rounded once), and the same grouped GEMMs (transformers' own ``_grouped_mm`` dispatcher: ``grouped_mm`` where
torch has it for the device and dtype, transformers' compile-safe per-expert fallback elsewhere), the model's own
gate activation (``_apply_gate`` / ``act_fn``), biases and post-expert norm. It traces under ``torch.compile``
without graph breaks, so the compiled decoder compiles it into the layer.

How: on transformers' own extension point. ``use_experts_implementation`` makes an experts class's forward run the
function ``ALL_EXPERTS_FUNCTIONS`` holds under ``config._experts_implementation``; this module registers
``actorcore_sorted`` and ``actorcore_quack`` there at import. A registered name decides nothing for a model whose
config does not name it. The config is shared by every layer and often by other models built from the same config
object (an actor and its reference model): naming the function there would turn the path on for all of them, and one
model's revert would turn it off under another. So ``patch_model`` names it on one shallow copy of the experts
modules' config per patch, given to every experts module of the model with the patch's trace slot (one object for
all layers: one compilation serves them); ``model.config`` is never touched. The function runs the path in
actorcore's calls only; elsewhere (the model's own forward, ``verify``'s reference) it runs what the original config
names now (``model.set_experts_implementation`` after the patch sets that, not the copy). Eager runs count under
``MOE_EXPERTS_KEY``; a layer the compiled decoder ran compiled took the path by construction; the ``MoeExperts``
feature requires every installed module to have run one way or the other, and names why where one left the path.
The copy and the slot sit in the modules' ``__dict__``, so ``copy.deepcopy`` and ``torch.save`` / ``torch.load`` keep
the patch; unpickling imports actorcore (the patch state's classes), which registers the names, so a load where
actorcore is not installed fails there.

Where: ``"sorted"`` (named ``"grouped"`` before: the old value still works for one release, with a
DeprecationWarning; transformers' own ``"grouped_mm"`` experts are another path) installs it on any device and
dtype it runs in (float32 on the CPU too), refusing what it does not cover (expert parallelism, other experts
classes); ``False`` keeps the model's own experts code; ``"auto"`` (the default) installs it where the compiled
decoder runs (a CUDA model with 16-bit weights), the combination measured faster side by side on the H200
(``bench/actor_step.py``), and keeps the model's own experts elsewhere or where the path refuses the model; models
with linear-attention layers included (their quack and sorted paths measured as close to fp32 as transformers'
experts, below).
Exactness, measured there per parameter (``tests/gpu/test_moe_experts_cuda.py``): under the compiled decoder the
path is as close to the fp32 model as transformers' ``grouped_mm`` experts under the same decoder; with the eager
decoder within bf16 rounding of transformers' eager experts.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any, Callable

import torch

from actorcore._moved import renamed
from actorcore.archs import submodule
from actorcore.hf.call import DecoderCall
from actorcore.hf.features.class_paths import TRACE_ATTR, ModulePathFeature, counted_call, install_each
from actorcore.hf.features.plan import FeatureOption, PlanFacts, check_choice
from actorcore.kernels.moe_permute import combine, expert_bias, permute, sort_by_expert
from actorcore.kernels.quack import runtime as quack_runtime
from actorcore.kernels.quack.moe import gated_experts

try:  # transformers' experts extension point (transformers 5); without it the path refuses every model
    from transformers.integrations import moe as transformers_moe
except ImportError:
    transformers_moe = None

logger = logging.getLogger(__name__)

MOE_EXPERTS_KEY = "moe_experts:modules"
# The plan's kernel -> the name of its function in transformers' ExpertsInterface (registered at import).
EXPERTS_FUNCTIONS = {"sorted": "actorcore_sorted", "quack": "actorcore_quack"}
OWN_CONFIG_ATTR = "_actorcore_own_config"  # on the patch's config copy: the config the experts modules had
MOE_EXPERTS_CHOICES = ("auto", "sorted", "quack", False)
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AUTO_REFUSAL = "the decoder is not compiled here (the path was measured faster only inside the compiled decoder)"
# Models with linear-attention layers (tests/gpu/test_moe_experts_cuda.py, the tiny Qwen3-Next with its MoE block in a
# compiled layer): through transformers' ExpertsInterface the sorted path's gradients, the decay parameters' included,
# were as close to the fp32 model as transformers' grouped_mm experts on four of four seeds (H200, 2026-12-07; the
# earlier per-class install was 2-4x further on two of four, which kept "auto" off these models), and quack's GEMMs
# were too (four of four, H100, 2026-12-07), so "auto" treats them as any MoE model.


@functools.cache
def _standard_experts_code() -> Any:
    """The code object of the ``forward`` that transformers' ``use_experts_implementation`` gives a class (None if
    this transformers has no such decorator)."""
    decorate = getattr(transformers_moe, "use_experts_implementation", None)
    if decorate is None:
        return None

    class _Probe(torch.nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()

        def forward(self) -> None:
            return None

    return decorate(_Probe).forward.__code__


def is_standard_experts(module: torch.nn.Module) -> bool:
    """Whether the module's class is one transformers' ``use_experts_implementation`` decorated (forward not
    overridden since)."""
    code = _standard_experts_code()
    return code is not None and getattr(type(module).forward, "__code__", None) is code


def _grouped_mm_dispatcher() -> Callable | None:
    """transformers' grouped GEMM dispatcher (``grouped_mm`` / ``_grouped_mm`` / its compile-safe fallback)."""
    return getattr(transformers_moe, "_grouped_mm", None)


def _expert_linear(grouped_mm: Callable, rows_SD: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   order: Any, transposed: bool) -> torch.Tensor:
    """Each sorted row through its expert's linear: ``weight`` is ``[E, out, in]`` (``[E, in, out]`` transposed)."""
    out = grouped_mm(rows_SD, weight if transposed else weight.transpose(-2, -1), order.offsets)
    return out if bias is None else out + expert_bias(bias, order)


def sorted_experts_forward(experts: torch.nn.Module, hidden_states_TD: torch.Tensor, top_k_index_TK: torch.Tensor,
                           top_k_weights_TK: torch.Tensor, grouped_mm: Callable, quack: bool = False) -> torch.Tensor:
    """transformers' experts math (``grouped_mm_experts_forward``) with the tokens moved by gathers both ways;
    ``grouped_mm(x, weight, offsets)``: transformers' grouped GEMM dispatcher. ``quack``: the SwiGLU MLP as quack's
    GEMMs with the gather and the activation inside them (``kernels.quack.moe``; a module ``quack_module_refusal``
    passes)."""
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError(f"{type(experts).__name__} is expert-parallel (experts split over ranks): actorcore's MoE "
                         "experts path does not handle its sentinel expert ids; patch with moe_experts=False")
    order = sort_by_expert(top_k_index_TK, experts.num_experts)
    if quack:
        return gated_experts(hidden_states_TD, top_k_weights_TK, experts.gate_up_proj, experts.down_proj, order)
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


def sorted_experts(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``ExpertsInterface`` function ``actorcore_sorted``: the path on transformers' grouped GEMMs in actorcore's
    calls, else the module's own experts code."""
    return _path_or_own(experts, hidden_states, top_k_index, top_k_weights, quack=False)


def quack_experts(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``ExpertsInterface`` function ``actorcore_quack``: the path on quack's fused GEMMs in actorcore's calls,
    else the module's own experts code."""
    return _path_or_own(experts, hidden_states, top_k_index, top_k_weights, quack=True)


def _path_or_own(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, quack: bool) -> torch.Tensor:
    if counted_call(experts, MOE_EXPERTS_KEY, "moe_experts"):  # an actorcore call, or inside a compiled layer
        return sorted_experts_forward(experts, hidden_states, top_k_index, top_k_weights, _grouped_mm_dispatcher(),
                                      quack)
    return own_experts_forward(experts)(experts, hidden_states, top_k_index, top_k_weights)


def own_experts_forward(experts: torch.nn.Module) -> Callable:
    """The experts function the module's own config names now (read at each call, so that
    ``model.set_experts_implementation`` after the patch still decides the model's own forward)."""
    own = getattr(experts.config, OWN_CONFIG_ATTR, None)
    name = None if own is None else own._experts_implementation
    if own is None or name in EXPERTS_FUNCTIONS.values():
        raise ValueError(f"{type(experts).__name__}'s config names {experts.config._experts_implementation!r}, "
                         "actorcore's MoE experts path, which patch_model(moe_experts=...) installs on a config copy "
                         "of the patched model's experts modules; name one of transformers' experts implementations "
                         "(e.g. model.set_experts_implementation('grouped_mm')) and patch the model instead")
    return transformers_moe.ALL_EXPERTS_FUNCTIONS.get_interface(name, type(experts).forward.__wrapped__)


def _register_experts_functions() -> None:
    """Add the two functions to transformers' ``ExpertsInterface`` table (at import: a model unpickled with the patch
    finds them). A registered name decides nothing for a model whose config does not name it."""
    interface = getattr(transformers_moe, "ExpertsInterface", None)
    if interface is not None:
        interface.register(EXPERTS_FUNCTIONS["sorted"], sorted_experts)
        interface.register(EXPERTS_FUNCTIONS["quack"], quack_experts)


_register_experts_functions()


def install_experts_function(modules: list[torch.nn.Module], trace: Any, name: str) -> Callable[[], None]:
    """Name the experts function ``name`` on one shallow copy of the modules' config (one per distinct config
    object; in the models covered all layers share one), given to each module with the patch's trace slot; returns
    the undo. The original config (``model.config``, and any other model holding it) keeps its experts code."""
    copies: dict[int, Any] = {}

    def put(module: torch.nn.Module) -> Callable[[], None]:
        own = module.config
        if id(own) not in copies:
            shared = copies[id(own)] = copy.copy(own)
            # The internal attribute: the property's setter also sets every sub-config, objects the copy shares.
            shared._experts_implementation_internal = name
            setattr(shared, OWN_CONFIG_ATTR, own)
        module.config = copies[id(own)]
        return lambda: setattr(module, "config", own)

    return install_each(modules, trace, put)


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
    named = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if "forward" in module.__dict__ or TRACE_ATTR in module.__dict__ or named in EXPERTS_FUNCTIONS.values():
        return f"{name} already has an instance forward or the MoE experts path: revert the other patch first"
    if getattr(transformers_moe, "ExpertsInterface", None) is None:
        return "the installed transformers has no ExpertsInterface (transformers.integrations.moe), which this path uses"
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
    return _dtype_refusal(module)


def _dtype_refusal(module: torch.nn.Module) -> str | None:
    """Why grouped_mm cannot run this experts module's weights (None: it can)."""
    weight = module.gate_up_proj if module.has_gate else module.up_proj
    if weight.dtype not in GROUPED_MM_DTYPES:
        return f"{type(module).__name__}'s weights are {weight.dtype}; grouped_mm runs float32, bf16 and fp16"
    return None


def _device_refusal(module: torch.nn.Module) -> str | None:
    """quack's GEMMs run 16-bit CUDA weights (``testing.quack_stand_in`` lifts this on the CPU)."""
    weight = module.gate_up_proj
    return None if weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) else "is not a 16-bit CUDA module"


def quack_module_refusal(module: torch.nn.Module) -> str | None:
    """Why quack's fused experts GEMMs do not cover this experts module's math (None: they do): a concatenated
    ``[gate; up]`` projection, transformers' own gate function with a SiLU activation, no bias, no post-expert norm,
    16-bit weights on a CUDA device, widths multiples of 8."""
    name = type(module).__name__
    from transformers.integrations import moe

    act = getattr(module, "act_fn", None)
    device_why = _device_refusal(module)
    checks = (
        (module.has_gate and getattr(module, "is_concatenated", True), "has no concatenated [gate; up] projection"),
        (not module.has_bias, "has biases"),
        (not module.is_transposed, "stores its weights transposed"),
        (not getattr(module, "has_post_expert_norm", False), "has a post-expert norm"),
        (getattr(type(module), "_apply_gate", None) is getattr(moe, "_default_apply_gate", None),
         "has its own gate function (_apply_gate)"),
        (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation", f"gates with {act!r}, not SiLU"),
        (device_why is None, device_why),
    )
    why = next((reason for ok, reason in checks if not ok), None)
    if why is not None:
        return f"{name} {why}: quack's fused experts GEMMs run SwiGLU experts only"
    return quack_runtime.width_refusal(name, hidden=module.down_proj.shape[1], intermediate=module.down_proj.shape[2])


def _quack_refusal_for(modules: list[torch.nn.Module]) -> str | None:
    """Why quack's fused GEMMs cannot run these experts modules here (None: they can)."""
    return quack_runtime.quack_refusal() or next((r for r in map(quack_module_refusal, modules) if r is not None), None)


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


class MoeExpertsOption(FeatureOption):
    """``moe_experts``: "auto", "sorted", "quack" or False; its value: the kernels that run ("sorted": the sorted path
    on transformers' grouped GEMMs / "quack") or False, on the experts modules it targets (names in the decoder)."""

    name = "moe_experts"
    keywords = {"moe_experts": "auto"}
    needs = ("compiled_decoder",)
    doc = ("the MoE layers' experts (transformers' standard experts class) run actorcore's path in its calls: the "
           "same grouped GEMMs and gate activation, with the tokens moved to their experts and back by gathers in "
           "both directions (deterministic; each token's sum over its experts in fp32, rounded once). ``'sorted'`` "
           "(formerly ``'grouped'``) installs it on any device and dtype and refuses a model it does not cover; "
           "``'quack'`` runs its SwiGLU MLP as quack's Hopper GEMMs (refused where they cannot run); ``'auto'`` "
           "(default) installs it where the decoder is compiled (measured faster there), on quack's GEMMs where they "
           "run and cover the model, else keeps the model's own experts code; ``False`` keeps the model's own experts "
           "code.")

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        request = asked["moe_experts"]
        if isinstance(request, str) and request == "grouped":
            renamed("moe_experts='grouped'", "moe_experts='sorted'", stacklevel=6)  # the caller of patch_model
            asked, request = {**asked, "moe_experts": "sorted"}, "sorted"
        check_choice("moe_experts", request, MOE_EXPERTS_CHOICES, "'sorted' installs actorcore's experts path, "
                     "'quack' that path with quack's fused GEMMs, False keeps the model's own experts code")
        if request is False:
            return self.decision(asked, False, "not asked: the model's own experts code")
        if request == "auto" and facts.spec.mlp_kind != "moe":
            return self.decision(asked, False, f"auto: {facts.spec.model_type} has no MoE layers")
        found = moe_experts_modules(facts.parts, facts.spec)
        why = _model_refusal(facts.model, facts.spec, found)
        modules = [module for _, module in found]
        if request == "quack" and why is None:
            why = _quack_refusal_for(modules)
        if request == "auto" and not decided["compiled_decoder"].on:
            why = AUTO_REFUSAL
        if why is not None:
            if request == "auto":
                return self.decision(asked, False, f"auto: {why}; the model's own experts code")
            raise ValueError(f"moe_experts={request!r}: {why}; pass moe_experts=False (the model's own experts code)"
                             + (" or 'sorted'" if request == "quack" else ""))
        kernel, how = request, "asked"
        if request == "auto":
            quack_why = _quack_refusal_for(modules)
            kernel, how = ("sorted", f"grouped_mm: {quack_why}") if quack_why else ("quack", "quack's GEMMs run here")
        return self.decision(asked, kernel, f"{len(found)} experts modules on actorcore's path ({how})",
                             (name for name, _ in found))


class MoeExperts(ModulePathFeature):
    """``patch_model(moe_experts=...)``: the experts modules named in the patch state run the ``ExpertsInterface``
    function of the plan's kernel (``install_experts_function``) for the patch's lifetime; ``check`` requires each of
    them to have run in the call: counted by its eager runs, or inside a layer the compiled decoder ran compiled
    (that feature checks its own count)."""

    name = "moe_experts"
    options = (MoeExpertsOption(),)
    key = MOE_EXPERTS_KEY
    what = "actorcore's MoE experts path ran in {ran} of {n} experts modules"

    def install_path(self, modules: list[torch.nn.Module], state: Any) -> Callable[[], None]:
        return install_experts_function(modules, state.trace, EXPERTS_FUNCTIONS[state.value("moe_experts")])

    def bypassed(self, module: torch.nn.Module, state: Any) -> str | None:
        name = type(module).__name__
        if not is_standard_experts(module) or "forward" in module.__dict__:
            return f"{name}'s forward no longer dispatches through transformers' ExpertsInterface (another patch)"
        named = getattr(getattr(module, "config", None), "_experts_implementation", None)
        ours = EXPERTS_FUNCTIONS[state.value("moe_experts")]
        if named != ours:
            return (f"{name}'s config names the experts implementation {named!r}, not {ours!r} (module.config "
                    "replaced, or its _experts_implementation set, after patch_model)")
        if module.__dict__.get(TRACE_ATTR) is not state.trace:
            return f"{name} no longer holds the patch's trace slot"
        return None

    def enter(self, call: DecoderCall) -> Any:
        """Refuse, before the forward, weights cast since the patch (``model.double()``) to a dtype the path does not
        run: else grouped_mm fails deep inside the first MoE layer."""
        for name in call.patch.targets(self.name):
            why = _dtype_refusal(call.parts.decoder.get_submodule(name))
            if why is not None:
                raise ValueError(f"{why}: the model was cast after patch_model installed actorcore's MoE experts path "
                                 "on it; cast it back, or handle.revert() and patch again with moe_experts=False "
                                 "(and, for float64, model.set_experts_implementation('eager'))")
        return super().enter(call)
