"""quack's gated MLP (``patch_model(swiglu_mlp=...)``): the decoder's SwiGLU MLPs with the activation inside their
GEMMs (``kernels.quack.gated_mlp``).

Why: in the compiled decoder the largest elementwise kernels left on a dense model's actor step are SwiGLU's forward
and backward passes, at the HBM rate; quack's epilogues compute them from the GEMMs' accumulators instead.

How: each covered MLP module runs, for the patch's lifetime, as a subclass of its own class (``class_paths``): in
actorcore's calls ``gated_mlp``, in any other call (the model's own forward, ``verify``'s reference) the class's own
forward. Eager runs count under ``SWIGLU_MLP_KEY``; an MLP inside a layer the compiled decoder ran compiled took
the path by construction; ``SwigluMLP.check`` requires every installed module to have run one way or the other.

Covered: transformers' gated MLP as Llama writes it (the same ``forward`` code: ``down_proj(act_fn(gate_proj(x)) *
up_proj(x))``), plain ``nn.Linear`` projections without bias (a LoRA-wrapped projection is not covered), SiLU, 16-bit
weights on a CUDA device: the MLPs of the decoder layers and the shared or dense MLPs of MoE models. ``"quack"``
installs it on every covered MLP and refuses where quack cannot run or nothing is covered; ``"auto"`` (the default)
installs it on the covered MLPs of compiled layers where quack runs (``kernels.quack.runtime.quack_refusal``), else
nothing; ``False`` keeps the model's own MLP code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch

from actorcore.archs import submodule
from actorcore.hf.features.class_paths import (TRACE_ATTR, ClassPathFeature, class_in_front, counted_call,
                                               reduce_to_path_class)
from actorcore.hf.features.plan import FeatureOption, PlanFacts, check_choice
from actorcore.kernels.quack import runtime as quack_runtime
from actorcore.kernels.quack.gated_mlp import gated_mlp

logger = logging.getLogger(__name__)

SWIGLU_MLP_KEY = "swiglu_mlp:modules"
GATE_UP_RECOMPUTED_KEY = "swiglu_mlp:gate_up_recomputed"  # eager runs that kept no pre-activation
SWIGLU_MLP_CHOICES = ("auto", "quack", False)


@functools.cache
def _llama_mlp_code() -> Any:
    """The code object of transformers' ``LlamaMLP.forward`` (None if this transformers has none)."""
    try:
        from transformers.models.llama.modeling_llama import LlamaMLP
    except ImportError:
        return None
    return LlamaMLP.forward.__code__


def is_standard_gated_mlp(module: torch.nn.Module) -> bool:
    """Whether the module's class runs Llama's gated MLP ``forward`` (the same instructions, names and constants:
    the families' copies of it are separate code objects)."""
    code, reference = getattr(type(module).forward, "__code__", None), _llama_mlp_code()
    return code is not None and reference is not None and all(
        getattr(code, attr) == getattr(reference, attr) for attr in ("co_code", "co_names", "co_consts", "co_varnames"))


def mlp_refusal(module: torch.nn.Module) -> str | None:
    """Why quack's gated MLP does not cover this module (None: it does)."""
    name = type(module).__name__
    if "forward" in module.__dict__ or isinstance(module, QuackGatedMLP):
        return f"{name} already has an instance forward or quack's gated MLP: revert the other patch first"
    if not is_standard_gated_mlp(module):
        return f"{name}'s forward is not transformers' gated MLP (down_proj(act_fn(gate_proj(x)) * up_proj(x)))"
    projections = [getattr(module, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(p) is torch.nn.Linear and p.bias is None for p in projections):
        return f"{name}'s projections are not plain nn.Linear without bias (LoRA-wrapped or biased)"
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return f"{name} gates with {act!r}, not SiLU"
    return _device_refusal(module)


def _device_refusal(module: torch.nn.Module) -> str | None:
    """Why quack cannot run this (covered) MLP's weights: 16-bit, one dtype, on a CUDA device, widths multiples
    of 8."""
    weights = [getattr(module, p).weight for p in ("gate_proj", "up_proj", "down_proj")]
    if not weights[0].is_cuda or any(w.dtype not in (torch.bfloat16, torch.float16) or w.dtype != weights[0].dtype
                                     for w in weights):
        return f"{type(module).__name__} is not a 16-bit CUDA module"
    intermediate, hidden = weights[0].shape
    return quack_runtime.width_refusal(type(module).__name__, hidden=hidden, intermediate=intermediate)


class QuackGatedMLP:
    """Put in front of a gated MLP's own class for the patch's lifetime (``quack_mlp_class``): its ``forward`` runs
    ``gated_mlp`` in actorcore's calls, else the class's own forward. Pickled and deep-copied as an instance of
    ``quack_mlp_class`` of its base (``class_paths.reduce_to_path_class``)."""

    _actorcore_base: type  # the module's own class
    # Set on an instance for one call by ``gate_up_recomputed`` (a checkpoint plan's layer): keep no pre-activation.
    actorcore_recompute_gate_up = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not counted_call(self, SWIGLU_MLP_KEY, "swiglu_mlp"):  # not an actorcore call: the model's own MLP code
            return type(self)._actorcore_base.forward(self, x)
        recompute = self.actorcore_recompute_gate_up
        if recompute and not torch.compiler.is_compiling():
            self.__dict__[TRACE_ATTR].counts[GATE_UP_RECOMPUTED_KEY] += 1
        out = gated_mlp(x.reshape(-1, x.shape[-1]), self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                        keep_preact=not recompute)
        return out.view(*x.shape[:-1], out.shape[-1])

    def __reduce_ex__(self, protocol: int) -> Any:
        return reduce_to_path_class(self, quack_mlp_class, type(self)._actorcore_base)


def quack_mlps(layer: torch.nn.Module) -> list[QuackGatedMLP]:
    """The MLP modules of ``layer`` that run quack's gated MLP (none where the patch did not install it)."""
    return [module for module in layer.modules() if isinstance(module, QuackGatedMLP)]


@contextlib.contextmanager
def gate_up_recomputed(layers: list[torch.nn.Module]) -> Iterator[None]:
    """For one call: the quack MLPs of ``layers`` keep no ``[T, 2I]`` pre-activation, their backward runs the
    gate/up GEMM again (``gated_mlp(keep_preact=False)``; a compiled layer compiles that variant once more)."""
    mlps = [mlp for layer in layers for mlp in quack_mlps(layer)]
    try:
        for mlp in mlps:
            mlp.actorcore_recompute_gate_up = True
        yield
    finally:
        for mlp in mlps:
            mlp.__dict__.pop("actorcore_recompute_gate_up", None)


@functools.cache
def quack_mlp_class(base: type) -> type:
    """The class an installed MLP of class ``base`` runs as (one per MLP class)."""
    return class_in_front(QuackGatedMLP, base)


def _covered_mlps(parts: Any, spec: Any, layers: list[int]) -> tuple[list[tuple[str, torch.nn.Module]], list[str]]:
    """``(covered (name in the decoder, module), why the others are not)`` among the gated MLPs under the MLP path
    of the given decoder layers."""
    names = {id(module): name for name, module in parts.decoder.named_modules()}
    covered, refused = [], []
    for index in layers:
        for module in submodule(parts.layers[index], spec.mlp).modules():
            if not all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
                continue
            why = mlp_refusal(module)
            if why is None:
                covered.append((names[id(module)], module))
            else:
                refused.append(why)
    return covered, refused


class SwigluMLPOption(FeatureOption):
    """``swiglu_mlp``: "auto", "quack" or False; its value: "quack" or False, on the MLP modules it targets (names in
    the decoder)."""

    name = "swiglu_mlp"
    keywords = {"swiglu_mlp": "auto"}
    needs = ("compiled_decoder",)
    doc = ("the SwiGLU MLPs (transformers' gated MLP with SiLU, plain projections; also MoE models' shared and dense "
           "MLPs) run in actorcore's calls with SwiGLU and its backward inside quack's Hopper GEMMs, the other GEMMs "
           "on cuBLAS. ``'auto'`` (default): the MLPs of the compiled layers where quack runs here (``quack-kernels`` "
           "with the CuTe DSL it pins, a Hopper GPU); ``'quack'`` every covered MLP, refusing where quack cannot "
           "run; ``False`` keeps the model's own MLP code.")

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        request = asked["swiglu_mlp"]
        check_choice("swiglu_mlp", request, SWIGLU_MLP_CHOICES, "'quack' runs the SwiGLU MLPs as quack's GEMMs with "
                     "the activation inside them, False keeps the model's own MLP code")
        if request is False:
            return self.decision(asked, False, "not asked: the model's own MLP code")
        fused = decided["compiled_decoder"].targets
        if request == "auto" and not fused:
            return self.decision(asked, False, "auto: the decoder is not compiled (quack's gated MLP is taken on "
                                 "compiled layers); the model's own MLP code")
        names, why = swiglu_mlp_names(facts.model, facts.parts, facts.spec, request, compiled_layers=fused)
        if not names:
            return self.decision(asked, False, f"auto: {why}; the model's own MLP code")
        where = "every covered MLP" if request == "quack" else "the covered MLPs of the compiled layers"
        return self.decision(asked, "quack", f"{where} on quack's gated GEMMs" + (f" ({why})" if why else ""),
                             names)


def swiglu_mlp_names(model: torch.nn.Module, parts: Any, spec: Any, request: Any, *, compiled_layers: tuple[int, ...]
                    ) -> tuple[tuple[str, ...], str | None]:
    """``(the MLP modules (names in the decoder) to run quack's gated MLP, a note)`` for ``"quack"`` (every layer)
    or ``"auto"`` (the compiled layers). ``"quack"`` raises ``ValueError`` with the reason where quack cannot run or
    covers none; ``"auto"`` returns no names and the reason. The note says which MLPs keep their own code."""
    layers = list(range(len(parts.layers))) if request == "quack" else list(compiled_layers)
    covered, refused = _covered_mlps(parts, spec, layers)
    uncovered = f"no MLP of {type(model).__name__} is covered ({refused[0] if refused else 'no gated MLP'})"
    why = quack_runtime.quack_refusal() or (None if covered else uncovered)
    if getattr(model, "_tp_size", None) not in (None, 1):
        why = f"{type(model).__name__} is tensor-parallel through transformers' tp_plan (its MLPs hold shards)"
    if why is not None:
        if request == "auto":
            return (), why
        raise ValueError(f"swiglu_mlp='quack': {why}; pass swiglu_mlp=False (the model's own MLP code)")
    note = f"{len(refused)} keep their own code: {refused[0]}" if refused else None
    return tuple(name for name, _ in covered), note


class SwigluMLP(ClassPathFeature):
    """``patch_model(swiglu_mlp=...)``: the MLPs named in the patch state run as ``quack_mlp_class`` for the patch's
    lifetime; ``check`` requires each of them to have run the path in the call."""

    name = "swiglu_mlp"
    options = (SwigluMLPOption(),)
    key = SWIGLU_MLP_KEY
    path_class = QuackGatedMLP
    what = "quack's gated MLP ran in {ran} of {n} MLP modules"

    def class_for(self, state: Any) -> Any:
        return quack_mlp_class
