"""``PlannedTransformerLayer``: Megatron's ``TransformerLayer`` with each call's recompute mode and, when built
fused, its elementwise work compiled (``build_gpt_model(..., compiled_layers=..., recompute=...)``).

It enters the model through the layer spec (``with_planned_layers``: megatron-core's ``ModuleSpec`` extension
point); its modules, parameters and state dict are ``TransformerLayer``'s. Each forward reads the call's
``LayerPlan`` from the micro-batch's ``BatchParams`` (``packed_seq_params.layer_plan``, set by
``mcore.run.forward``): the layer's mode (``mcore/build/recompute.py``: ``"none"``, ``"selective"`` under PyTorch's
selective checkpoint with actorcore's keep-the-GEMMs policy, ``"full"`` under torch's non-reentrant checkpoint;
only in a training forward with gradients) and the call's trace, where it counts what ran.

Fused (``fused=True``): the layer's forward is ``TransformerLayer.forward`` for what actorcore's configs build
(self-attention, no cross-attention, no dropout, no inference context), with its elementwise regions compiled
(``mcore/build/fused_ops.py``): the input norm, the attention output's residual add with the pre-MLP norm, and the MLP
output's residual add. A dense MLP runs its activation compiled (``fused_mlp``) or, built with
``swiglu_mlp="quack"`` (the default where quack runs and covers the MLP: ``quack_mlp_refusal``), as quack's gated
GEMMs with SwiGLU in their epilogues, the HF route's kernel (``kernels.quack.gated_mlp``; counted under
``QUACK_MLP_KEY``); the routed experts run their activation in ``GroupedExperts``. RoPE runs compiled in the core
attention, from angles made once per micro-batch without a host synchronisation (``mcore/build/fused_rope.py``, where
it covers the layer; counted under ``FUSED_ROPE_KEY``), and the q/k norms in one compiled region on views of the QKV
projection, without Megatron's copy of q (``mcore/build/qk_norm.py``, where it covers the attention; counted under
``FUSED_QK_NORM_KEY``). At one TP rank the QKV projection and a dense MLP's first GEMM keep their norm's input, not
its output, and rerun the norm in backward (``mcore/build/normed_projection.py``; counted under
``RECOMPUTED_NORM_KEY``). The attention's projections, the MoE router and the dispatcher's communication stay
Megatron's eager code: their collectives and host synchronisation would
split a compiled graph. A fused forward counts under ``COMPILED_KEY``. On CUDA with 16-bit weights by default
(``compiled_layers="auto"``); ``True`` compiles on any device (Inductor's C++ kernels on the CPU), fp32 too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import torch
import torch.utils.checkpoint

from actorcore.kernels.recomputed_input import RecomputedInput
from actorcore.kernels.selective_checkpoint import SelectiveContexts
from actorcore.mcore.build.fused_ops import add_then_norm, apply_norm, compiled, gated_activation, residual_add
from actorcore.mcore.build.fused_rope import fused_rope_refusal, rope_request
from actorcore.mcore.build.normed_projection import RECOMPUTED_NORM_KEY, use_norm_recomputing_projection
from actorcore.mcore.build.qk_norm import FUSED_QK_NORM_KEY, use_fused_qk_norms
from actorcore.mcore.build.recompute import FULL, FULL_KEY, KEPT_KEY, NONE, SELECTIVE, SELECTIVE_KEY
from actorcore.mcore.build.rotated_qk import ROTATED_QK_KEY, RotatedQk

try:  # megatron-core is optional; this module is only imported after require_megatron()
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer
except ImportError:  # pragma: no cover - guarded by require_megatron
    MLP = TransformerLayer = torch.nn.Module  # type: ignore[misc,assignment]

COMPILED_KEY = "mcore:compiled_layers"  # layer forwards that ran the compiled elementwise regions
COMPILED_CHOICES = ("auto", True, False)
QUACK_MLP_KEY = "mcore:quack_mlp"  # dense MLP forwards on quack's gated GEMMs
SWIGLU_MLP_CHOICES = ("auto", "quack", False)


class PlannedTransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose forward follows the call's ``LayerPlan`` and, when ``fused``, compiles its
    elementwise regions."""

    def __init__(self, *args: Any, fused: bool = False, quack_mlp: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused = fused
        self.quack_mlp = quack_mlp  # a dense MLP on quack's gated GEMMs (swiglu_mlp="quack"; fused layers only)
        self.fused_qk_norms = fused and use_fused_qk_norms(self.self_attention)  # mcore/build/qk_norm.py
        # mcore/build/normed_projection.py: the QKV projection and the MLP (a dense one's fc1 or quack's GEMMs, an MoE
        # layer's router and local experts) keep their norm's input, not its output
        self.recompute_qkv_input = fused and use_norm_recomputing_projection(
            getattr(self.self_attention, "linear_qkv", None), self.config)
        self.recompute_rotated_qk = fused  # mcore/build/rotated_qk.py, where the q/k norms and RoPE are fused
        self.recompute_mlp_input = fused and (
            quack_mlp if type(self.mlp) is MLP and quack_mlp else
            use_norm_recomputing_projection(self.mlp.linear_fc1, self.config) if type(self.mlp) is MLP else
            getattr(self.mlp, "recomputes_norm_input", False))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plan = getattr(kwargs.get("packed_seq_params"), "layer_plan", None)
        training = self.training and torch.is_grad_enabled()
        mode = plan.mode_of(self) if plan is not None and training else NONE
        if plan is not None and training:
            plan.count({FULL: FULL_KEY, SELECTIVE: SELECTIVE_KEY, NONE: KEPT_KEY}[mode])
        if mode == NONE:
            return self._measured(plan, mode, *args, **kwargs) if training else self._run(plan, *args, **kwargs)
        context = {} if mode == FULL else {"context_fn": SelectiveContexts(plan.trace)}
        run = functools.partial(torch.utils.checkpoint.checkpoint, self._run, plan, use_reentrant=False, **context)
        return self._measured(plan, mode, *args, run=run, **kwargs) if mode == SELECTIVE else run(*args, **kwargs)

    def _measured(self, plan: Any, mode: str, *args: Any, run: Any = None, **kwargs: Any) -> Any:
        """The forward, measuring on CUDA what the layer holds afterwards beyond its output (``LayerPlan.record``)."""
        run = run or functools.partial(self._run, plan)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if plan is None or hidden is None or not hidden.is_cuda:
            return run(*args, **kwargs)
        before = torch.cuda.memory_allocated(hidden.device)
        out = run(*args, **kwargs)
        plan.record(self, mode, torch.cuda.memory_allocated(hidden.device) - before - out[0].nbytes)
        return out

    def _run(self, plan: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.fused:
            return super().forward(*args, **kwargs)
        if plan is not None:
            plan.count(COMPILED_KEY)
        return self._fused_forward(*args, **kwargs)

    def _fused_forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, context: Any = None,
                       context_mask: Any = None, rotary_pos_emb: Any = None, rotary_pos_cos: Any = None,
                       rotary_pos_sin: Any = None, rotary_pos_cos_sin: Any = None, attention_bias: Any = None,
                       inference_context: Any = None, packed_seq_params: Any = None, sequence_len_offset: Any = None,
                       padding_mask: Any = None, **_: Any) -> tuple[torch.Tensor, Any]:
        """``TransformerLayer.forward`` (self-attention, dropout 0, no inference context) with the norms and
        residual adds compiled."""
        if inference_context is not None:
            raise ValueError("the fused Megatron layers run training and scoring forwards, not inference with a KV "
                             "cache: build the model with compiled_layers=False")
        normed = compiled(apply_norm)(self.input_layernorm, hidden_states)
        attention_params = packed_seq_params
        if fused_rope_refusal(self.self_attention, rotary_pos_emb, packed_seq_params) is None:
            # the core attention rotates q and k (mcore/build/fused_rope.py), Megatron's attention does not
            request = rope_request(self.self_attention, rotary_pos_emb)
            attention_params, rotary_pos_emb = dataclasses.replace(packed_seq_params, rope=request), None
        fused_qk_calls = self.self_attention.fused_calls if self.fused_qk_norms else 0
        plan = getattr(packed_seq_params, "layer_plan", None)
        projection = self.self_attention.linear_qkv if self.recompute_qkv_input else None
        lent = lending(projection, normed, RecomputedInput(hidden_states, functools.partial(
            compiled(apply_norm), self.input_layernorm)), plan)
        rotated = self._rotated_qk(plan, attention_params)
        collecting = rotated.collecting(self.self_attention, self.self_attention.core_attention) \
            if rotated is not None else contextlib.nullcontext()
        with lent, collecting:
            attention = self.self_attention(normed, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                            rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                                            rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                                            packed_seq_params=attention_params,
                                            sequence_len_offset=sequence_len_offset)
        if plan is not None and self.fused_qk_norms and self.self_attention.fused_calls > fused_qk_calls:
            plan.count(FUSED_QK_NORM_KEY)
        if plan is not None and rotated is not None and rotated.recomputes():
            plan.count(ROTATED_QK_KEY)
        if self.recompute_mlp_input:
            # the pre-MLP norm apart from the add, so that backward reruns that graph on the kept sum (bitwise)
            hidden = compiled(residual_add)(*attention, hidden_states)
            normed = compiled(apply_norm)(self.pre_mlp_layernorm, hidden)
            origin = RecomputedInput(hidden, functools.partial(compiled(apply_norm), self.pre_mlp_layernorm))
        else:
            hidden, normed = compiled(add_then_norm)(*attention, hidden_states, self.pre_mlp_layernorm)
            origin = None
        mlp_out, mlp_bias = self._fused_mlp(normed, origin, plan, padding_mask)
        return compiled(residual_add)(mlp_out, mlp_bias, hidden), context

    def _rotated_qk(self, plan: Any, attention_params: Any) -> RotatedQk | None:
        """A record for this call's rotated q and k to be made again in backward rather than kept
        (``mcore/build/rotated_qk.py``): a training forward keeping its activations, the q/k norms fused and RoPE in
        the core attention; None elsewhere."""
        keeps = self.training and torch.is_grad_enabled() and (plan is None or plan.mode_of(self) == NONE)
        rope_here = getattr(attention_params, "rope", None) is not None
        return RotatedQk() if keeps and self.recompute_rotated_qk and self.fused_qk_norms and rope_here else None

    def _fused_mlp(self, normed: torch.Tensor, origin: RecomputedInput | None, plan: Any, padding_mask: Any
                   ) -> tuple[torch.Tensor, Any]:
        """The MLP on the pre-MLP norm's output; with ``origin``, keeping the norm's input instead of its output."""
        if type(self.mlp) is MLP and self.quack_mlp:
            if plan is not None:
                plan.count(QUACK_MLP_KEY)
                if origin is not None and torch.is_grad_enabled():
                    plan.count(RECOMPUTED_NORM_KEY)
            return quack_mlp(self.mlp, normed, origin)
        dense = type(self.mlp) is MLP  # (MoE layers compile their experts' activation themselves)
        with lending(None if origin is None else self.mlp.linear_fc1 if dense else self.mlp, normed, origin, plan):
            return fused_mlp(self.mlp, normed) if dense else self.mlp(normed, padding_mask=padding_mask)


@contextlib.contextmanager
def lending(lender: Any, normed: torch.Tensor, origin: RecomputedInput | None, plan: Any) -> Any:
    """Within the block ``lender`` (a ``normed_projection.LentNormInput``; None: nothing lent) keeps ``origin``'s
    source instead of ``normed``; the call's trace counts ``RECOMPUTED_NORM_KEY`` if it did."""
    if lender is None or origin is None:
        yield
        return
    calls = lender.recomputing_calls
    with lender.normed_from(normed, origin):
        yield
    if plan is not None and lender.recomputing_calls > calls:
        plan.count(RECOMPUTED_NORM_KEY)


def fused_mlp(mlp: Any, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A dense Megatron ``MLP``'s forward with its activation compiled (``fused_ops.gated_activation``): fc1, the
    fused activation, fc2 (``MLP.forward`` without a per-token scale, Megatron's unfused activation)."""
    config = mlp.config
    inter, bias = mlp.linear_fc1(x)
    inter = compiled(gated_activation)(inter, bias, config.activation_func, config.gated_linear_unit,
                                       config.activation_func_clamp_value, config.glu_linear_offset)
    return mlp.linear_fc2(inter)


def quack_mlp(mlp: Any, x: torch.Tensor, x_from: RecomputedInput | None = None) -> tuple[torch.Tensor, None]:
    """A dense Megatron ``MLP`` (SwiGLU, no biases, one TP rank) as quack's gated GEMMs: the HF route's
    ``kernels.quack.gated_mlp`` on views of fc1's ``[gate; up]`` rows and fc2's weight (``x_from``: ``x``'s source
    and norm, kept instead of ``x``)."""
    from actorcore.kernels.quack.gated_mlp import gated_mlp

    fc1_OD = mlp.linear_fc1.weight
    half = fc1_OD.shape[0] // 2
    out_TD = gated_mlp(x.reshape(-1, x.shape[-1]), fc1_OD[:half], fc1_OD[half:], mlp.linear_fc2.weight, x_from)
    return out_TD.view(*x.shape[:-1], out_TD.shape[-1]), None


def quack_mlp_refusal(config: Any, dtype: torch.dtype) -> str | None:
    """Why quack's gated GEMMs do not run this config's dense MLPs here (None: they do): SwiGLU (SiLU gate, no clamp
    or offset), no biases, one TP rank, bf16 / fp16, no fp8 and no fused weight-gradient accumulation, widths
    multiples of 8, on a GPU quack runs on."""
    from actorcore.kernels.quack import runtime as quack_runtime
    from actorcore.mcore.build.grouped_experts import quack_swiglu_refusal

    checks = (
        (config.tensor_model_parallel_size == 1, "tensor parallelism (the MLP's output is reduced over TP ranks)"),
        (not (config.fp8 or config.fp4), "fp8 / fp4 layers"),
        (not config.gradient_accumulation_fusion, "gradient_accumulation_fusion (weight gradients into main_grad)"),
    )
    why = quack_swiglu_refusal(config, dtype) or next((what for ok, what in checks if not ok), None) \
        or quack_runtime.quack_refusal()
    if why is not None:
        return f"quack's gated MLP does not run here: {why}"
    return quack_runtime.width_refusal("the MLP", hidden=config.hidden_size, intermediate=config.ffn_hidden_size)


def resolve_swiglu_mlp(request: Any, config: Any, dtype: torch.dtype, fused: bool) -> str | bool:
    """``build_gpt_model(swiglu_mlp=request)``: ``"quack"`` (refused with the reason where it cannot run, or without
    the compiled layers it runs in), ``False`` (the compiled activation between cuBLAS GEMMs), or ``"auto"``: quack
    where it runs, in compiled layers."""
    if request is True or not isinstance(request, (str, bool)) or request not in SWIGLU_MLP_CHOICES:
        raise ValueError(f"swiglu_mlp must be one of {SWIGLU_MLP_CHOICES}, got {request!r}")
    if request is False:
        return False
    why = quack_mlp_refusal(config, dtype)
    if request == "quack":
        if not fused:
            raise ValueError("swiglu_mlp='quack' runs inside the compiled layers: pass compiled_layers=True (or "
                             "'auto' on CUDA with 16-bit weights), or swiglu_mlp=False")
        if why is not None:
            raise ValueError(f"swiglu_mlp='quack': {why}; pass swiglu_mlp=False")
        return "quack"
    return "quack" if fused and why is None else False


def compiled_layers_refusal(config: Any) -> str | None:
    """Why the fused forward does not cover this config's layers (None: it does)."""
    checks = (
        (config.hidden_dropout, f"hidden_dropout={config.hidden_dropout} (the fused residual adds have no dropout)"),
        (config.fp8 or config.fp4, "fp8 / fp4 layers (TransformerEngine's)"),
        (config.recompute_granularity == "selective" and {"layernorm", "mlp"} & set(config.recompute_modules or ()),
         "Megatron's selective recompute of the norms or the MLP (recompute_modules 'layernorm' / 'mlp')"),
        (getattr(config, "cpu_offloading", False), "Megatron's activation offload"),
        (getattr(config, "cuda_graph_impl", "none") not in (None, "none"), "CUDA graphs"),
    )
    return next((f"the compiled layers do not run {what}" for on, what in checks if on), None)


def resolve_compiled_layers(request: Any, config: Any, dtype: torch.dtype) -> bool:
    """``build_gpt_model(compiled_layers=request)``: ``True`` (refused where the fused forward does not cover the
    config), ``False``, or ``"auto"``: on CUDA with bf16 / fp16 weights and Triton, where it was built to be faster."""
    if request not in COMPILED_CHOICES or isinstance(request, int) and not isinstance(request, bool):
        raise ValueError(f"compiled_layers must be True, False or 'auto', got {request!r}")
    if request is False:
        return False
    why = compiled_layers_refusal(config)
    if request is True:
        if why is not None:
            raise ValueError(f"compiled_layers=True: {why}; pass compiled_layers=False")
        return True
    return why is None and torch.cuda.is_available() and dtype in (torch.bfloat16, torch.float16) \
        and _has_triton()


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def with_planned_layers(layer_spec: Any, fused: bool, swiglu_mlp: str | bool = False) -> Any:
    """A decoder layer spec building ``PlannedTransformerLayer`` (``fused``: with its elementwise work compiled;
    ``swiglu_mlp="quack"``: its dense MLP on quack's gated GEMMs)."""
    if layer_spec.module is not TransformerLayer:
        raise ValueError(f"the decoder layer spec builds {layer_spec.module.__name__}, not megatron-core's "
                         "TransformerLayer, which actorcore's planned layers extend")
    params = {**layer_spec.params, "fused": fused, "quack_mlp": fused and swiglu_mlp == "quack"}
    return dataclasses.replace(layer_spec, module=PlannedTransformerLayer, params=params)
