"""Megatron's routed experts as grouped GEMMs (``build_gpt_model(..., moe_experts=...)``).

Legend: ``S`` rows a token dispatcher sorted by local expert, ``E`` local experts, ``D`` hidden, ``O`` the first
projection's width (``2 I`` gated), ``I`` the experts' intermediate width (this expert-TP rank's share).

Why: megatron-core's local experts (``SequentialMLP``) run one ``MLP`` per expert in a Python loop; its grouped
experts need TransformerEngine or the ``grouped_gemm`` package. On the H200 the Megatron route's MoE step
(Qwen3-30B-A3B shape, 128 experts) ran at a quarter of the HF route's speed, mostly waiting on that loop.
``GroupedExperts`` is ``SequentialMLP`` with another forward: the same modules and parameters (one ``MLP`` per local
expert, ``local_experts.{e}.linear_fc1.weight`` ...), so the same state dict, sharded state dict, conversion rules
and Megatron DDP / optimizer treatment; only the forward runs each projection of all local experts as one grouped
GEMM (``kernels.grouped_gemm``: torch's ``grouped_mm``), or the SwiGLU MLP as quack's gated GEMMs
(``kernels.quack.moe.gated_expert_rows``) where quack runs. The token dispatchers (all-gather, all-to-all: expert
parallelism), the router (auxiliary loss, score-correction bias) and the combine are megatron-core's, unchanged;
where one rank holds every expert, ``forward_tokens`` takes the tokens without a dispatcher (``gather_dispatch``).

The math is ``MLP.forward``'s with ``per_token_scale`` (what ``SequentialMLP`` calls per expert): fc1 (+ bias), the
gated activation (gpt-oss's clamp and linear offset included), the routing probability times the activation in
fp32 rounded once, fc2, and fc2's bias weighted by the probability. No communication inside: with expert tensor
parallelism the dispatcher reduces the partial outputs (as for ``SequentialMLP``'s linears, whose explicit expert
communication skips theirs). On the CPU in fp32 the outputs and gradients equal ``SequentialMLP``'s to fp32
summation order (bitwise at the Qwen3-MoE test shapes; torch's CPU ``grouped_mm`` and MKL's per-expert GEMMs may add
in other orders).

The weights are not copied per call: ``pack_expert_parameters`` lays each layer's per-expert tensors out as
consecutive slices of one stacked tensor (``[E, O, D]`` ...), so the grouped GEMM reads them in place
(``kernels.grouped_gemm.stack_experts``), and the stacked weight's gradient goes back to each expert's parameter as
a slice. Where something later gives the parameters other storage (``module.to(...)``, Megatron's distributed
optimizer's buffers), each GEMM stacks a copy instead, in forward and again in backward (never kept in between:
the memory of one layer's experts for the duration of one GEMM), with the same values.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from actorcore.kernels.grouped_gemm import consecutive, group_offsets, grouped_linear
from actorcore.kernels.moe_permute import bias_of_rows, sum_rows_per_token, weighted_rows_per_token
from actorcore.kernels.quack import runtime as quack_runtime
from actorcore.mcore.build.fused_ops import compiled, expert_activation

try:  # megatron-core is optional; this module is only imported after require_megatron()
    from megatron.core.transformer.moe.experts import SequentialMLP
except ImportError:  # pragma: no cover - guarded by require_megatron
    SequentialMLP = torch.nn.Module  # type: ignore[misc,assignment]

logger = logging.getLogger(__name__)

MOE_EXPERTS_CHOICES = ("auto", "grouped", "quack", "sequential")
GROUPED, QUACK, SEQUENTIAL = "grouped", "quack", "sequential"
GROUPED_EXPERTS_KEY = "moe_experts:grouped_calls"  # expert modules' forwards that ran grouped (any kernel)
QUACK_EXPERTS_KEY = "moe_experts:quack_calls"  # those of them on quack's gated GEMMs
_PARAMETERS = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")


def pack_expert_parameters(chunk: torch.nn.Module) -> int:
    """Lay each ``GroupedExperts`` module's per-expert tensors out as consecutive slices of one stacked tensor (in
    place of their own storage, values unchanged), so its forward reads them without a copy. Run after the model
    has its final device and dtype. Returns the number of modules packed."""
    packed = 0
    for module in chunk.modules():
        if not isinstance(module, GroupedExperts):
            continue
        for name in _PARAMETERS:
            params = module.expert_tensors(name)
            if params is None or consecutive(params):
                continue
            with torch.no_grad():
                base = torch.stack([p.detach() for p in params])
            for index, param in enumerate(params):
                param.data = base[index]
        packed += 1
    return packed


class GroupedExperts(SequentialMLP):
    """``SequentialMLP``'s modules and parameters, run as grouped GEMMs.

    ``kernel``: ``"grouped"`` (torch's ``grouped_mm``, one GEMM per expert where it cannot run) or ``"quack"``
    (quack's gated GEMMs; a module ``quack_experts_refusal`` passes); ``fused``: the activation compiled
    (``fused_ops``, with the compiled layers of ``mcore/build/layer.py``). ``calls`` counts its forwards (a call
    of ``compute_logprobs`` compares it before and after: the proof the path ran)."""

    def __init__(self, num_local_experts: int, config: Any, submodules: Any, pg_collection: Any = None,
                 kernel: str = GROUPED, fused: bool = False) -> None:
        super().__init__(num_local_experts, config, submodules, pg_collection)
        if kernel not in (GROUPED, QUACK):
            raise ValueError(f"GroupedExperts runs the 'grouped' or 'quack' kernel, got {kernel!r}")
        self.kernel = kernel
        self.fused = fused
        self.calls = 0

    def expert_tensors(self, name: str) -> list[torch.Tensor] | None:
        """Each local expert's tensor ``name`` (``"linear_fc1.weight"`` ...), or None where the experts have none."""
        owner, attr = name.split(".")
        tensors = [getattr(getattr(expert, owner), attr) for expert in self.local_experts]
        return None if any(t is None for t in tensors) else tensors

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.calls += 1
        rows, probs = permuted_local_hidden_states, permuted_probs
        config = self.config
        if config.moe_apply_probs_on_input:  # as SequentialMLP: the probabilities scale the input rows instead
            rows = (probs.unsqueeze(-1) * rows).to(rows.dtype)
            probs = torch.ones_like(probs)
        counts = torch.as_tensor(tokens_per_expert)
        offsets = group_offsets(counts, rows.device)
        fc1, fc2 = self.expert_tensors("linear_fc1.weight"), self.expert_tensors("linear_fc2.weight")
        if self.kernel == QUACK and rows.shape[0]:  # (a rank without rows takes the grouped GEMMs' empty path)
            from actorcore.kernels.quack.moe import gated_expert_rows

            return gated_expert_rows(rows, probs, fc1, fc2, offsets), None
        bias1, bias2 = (None if b is None else torch.stack(b) for b in (self.expert_tensors("linear_fc1.bias"),
                                                                        self.expert_tensors("linear_fc2.bias")))
        expert_of_row = None
        if bias1 is not None or bias2 is not None:
            experts = torch.arange(len(self.local_experts), device=rows.device)
            expert_of_row = torch.repeat_interleave(experts, counts.to(rows.device), output_size=rows.shape[0])
        inter = grouped_linear(rows, fc1, offsets)
        activation = compiled(expert_activation) if self.fused else expert_activation
        inter = activation(inter, None if bias1 is None else bias_of_rows(bias1, expert_of_row), probs,
                           config.activation_func, config.gated_linear_unit, config.activation_func_clamp_value,
                           config.glu_linear_offset)
        out = grouped_linear(inter, fc2, offsets)
        if bias2 is not None:  # MLP.forward: fc2's bias weighted by the probability, added in fp32, rounded once
            out = (out + bias_of_rows(bias2, expert_of_row) * probs.unsqueeze(-1)).to(out.dtype)
        return out, None

    def forward_tokens(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, order: Any,
                       x_from: Any = None) -> torch.Tensor:
        """``[T, D]``: the tokens themselves through their experts (every expert on this rank, no dispatcher), each
        output weighted by its routing probability and summed in fp32 (``kernels.quack.moe.gated_experts``: the
        rows gathered in the GEMM's loads). quack's kernel only (``gather_dispatch.local_experts_refusal``).
        ``x_from``: ``x``'s source and norm (``kernels.recomputed_input``), kept instead of ``x``."""
        from actorcore.kernels.quack.moe import RowPasses, gated_experts

        self.calls += 1
        passes = RowPasses(compiled(weighted_rows_per_token), compiled(sum_rows_per_token)) if self.fused \
            else RowPasses()
        return gated_experts(x_TD, weights_TK, self.expert_tensors("linear_fc1.weight"),
                             self.expert_tensors("linear_fc2.weight"), order, passes, x_from)


def _has_tensor(module: torch.nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner), attr, None) is not None


def grouped_experts_refusal(config: Any) -> str | None:
    """Why ``GroupedExperts`` does not cover this config's experts (None: it does)."""
    checks = (
        (config.fp8 or config.fp4, "fp8 / fp4 experts (TransformerEngine's)"),
        (getattr(config, "delay_wgrad_compute", False), "delay_wgrad_compute (weight gradients computed later)"),
        (getattr(config, "use_te_activation_func", False), "TransformerEngine's activation functions"),
        (config.moe_grouped_gemm, "moe_grouped_gemm=True (megatron-core's own grouped experts)"),
        (getattr(config, "moe_pad_expert_input_to_capacity", False), "expert inputs padded to capacity"),
    )
    return next((f"the grouped experts do not run {what}" for on, what in checks if on), None)


def quack_experts_refusal(config: Any, dtype: torch.dtype) -> str | None:
    """Why quack's gated GEMMs do not cover this config's experts here (None: they do): a SwiGLU (SiLU gate, no
    clamp, no offset) without biases, bf16 / fp16, widths multiples of 8, on a GPU quack runs on."""
    why = grouped_experts_refusal(config) or quack_runtime.quack_refusal()
    if why is not None:
        return why
    why = quack_swiglu_refusal(config, dtype) or (
        "moe_apply_probs_on_input=True" if config.moe_apply_probs_on_input else None)
    if why is not None:
        return f"quack's gated GEMMs run SwiGLU experts only: {why}"
    width = config.moe_ffn_hidden_size // config.expert_tensor_parallel_size
    return quack_runtime.width_refusal("the experts", hidden=config.hidden_size, intermediate=width)


def quack_swiglu_refusal(config: Any, dtype: torch.dtype) -> str | None:
    """Why quack's gated GEMMs cannot compute this config's MLPs (experts or dense; None: they can): they take a
    SwiGLU (SiLU gate, no clamp or offset) without biases, in bf16 / fp16."""
    import torch.nn.functional as F

    checks = (
        (config.gated_linear_unit and config.activation_func is F.silu, "the activation is not SwiGLU"),
        (config.activation_func_clamp_value is None and not config.glu_linear_offset,
         "the GLU clamps or offsets (gpt-oss)"),
        (not config.add_bias_linear, "the MLPs have biases"),
        (dtype in (torch.bfloat16, torch.float16), f"the model is {dtype}, not bf16 / fp16"),
    )
    return next((reason for ok, reason in checks if not ok), None)


def check_moe_experts_request(request: Any) -> None:
    if request not in MOE_EXPERTS_CHOICES or not isinstance(request, str):
        raise ValueError(f"moe_experts must be one of {MOE_EXPERTS_CHOICES}, got {request!r} ('grouped': torch's "
                         "grouped_mm, 'quack': quack's gated GEMMs, 'sequential': megatron-core's SequentialMLP, "
                         "'auto': quack where it runs, else grouped)")


def resolve_moe_experts(request: Any, config: Any, dtype: torch.dtype) -> str | None:
    """The experts kernel for ``build_gpt_model(moe_experts=request)`` (None for a model without MoE layers):
    ``"auto"`` takes quack where ``quack_experts_refusal`` passes, else ``"grouped"`` where
    ``grouped_experts_refusal`` does, else megatron-core's ``"sequential"``; an explicit kernel that cannot run is
    refused with the reason."""
    check_moe_experts_request(request)
    if not config.num_moe_experts:
        return None
    if request == SEQUENTIAL:
        return SEQUENTIAL
    if request == "auto":
        why_quack = quack_experts_refusal(config, dtype)
        if why_quack is None:
            return QUACK
        why = grouped_experts_refusal(config)
        logger.debug("moe_experts='auto': %s", why_quack)
        if why is not None:
            logger.info("moe_experts='auto' keeps megatron-core's sequential experts: %s", why)
            return SEQUENTIAL
        return GROUPED
    why = grouped_experts_refusal(config) if request == GROUPED else quack_experts_refusal(config, dtype)
    if why is not None:
        raise ValueError(f"moe_experts={request!r}: {why}; pass moe_experts='sequential' (megatron-core's experts)"
                         + (" or 'grouped'" if request == QUACK else ""))
    return request


def grouped_calls(chunks: list[torch.nn.Module]) -> dict[str, int]:
    """The forwards each kernel's ``GroupedExperts`` modules of ``chunks`` have run so far (by kernel)."""
    counts = {GROUPED: 0, QUACK: 0}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, GroupedExperts):
                counts[module.kernel] += module.calls
    return counts
