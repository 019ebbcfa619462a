"""Megatron's all-to-all token dispatcher with its two local permutations done by gathers only (the grouped experts'
MoE layers: ``moe_experts="grouped"`` / ``"quack"``).

Why: without Transformer Engine, megatron-core's dispatcher moves tokens to their experts with
``tokens.index_select(0, sorted_indices)``, whose backward is an ``index_add`` with duplicate indices (atomics in
bf16), and back with ``scatter_add_`` into zeros in the experts' dtype (atomics again, bf16 sums in whatever order the
atomics land). On the H100 those were the Megatron route's largest copy kernels of the MoE step (103 ms of
``indexFuncLargeIndex`` and 46 ms of scatter-add in a 2.1 s step). The HF route's gather-only permutation
(``kernels.moe_permute``) does the same moves as gathers both ways, each token's sum over its ``K`` rows in fp32,
rounded once: deterministic, and no atomics.

How: ``GatherMoELayer`` is megatron-core's ``MoELayer`` (the same modules, parameters and state dict) whose
all-to-all dispatcher runs as ``GatherTokenDispatcher``: ``dispatch_preprocess`` and ``combine_postprocess`` are
megatron-core 0.16's with ``permute`` / ``unpermute`` replaced; the rows come out in megatron's order (by expert,
tokens ascending within an expert), so the all-to-all, the experts and expert parallelism are unchanged. Each
dispatch counts in the dispatcher's ``dispatches`` (a call's trace: ``GATHER_DISPATCH_KEY``).

Where (``gather_dispatch_refusal``): the all-to-all dispatcher without capacity (token dropping or padding), router
padding for quantisation or Transformer Engine's fused permutation; elsewhere megatron-core's dispatcher runs.

Local experts (``local_experts_refusal``): where one rank holds every expert of the layer whole (EP = 1, expert TP =
1) and they run quack's gated GEMMs, there is nothing to dispatch, and the layer skips the dispatcher: the tokens go
to ``kernels.quack.moe.gated_experts``, the HF route's kernel, which gathers each row in the GEMM's loads and weighs
and sums each token's ``K`` rows in fp32 (the combine's backward inside the down projection's input-gradient GEMM).
On the dispatcher's path the ``[T * K, D]`` rows were written, kept for backward and summed back in separate passes,
and the per-expert token counts were read to the host in every layer. Router, auxiliary losses, shared experts,
parameters and state dict are unchanged; the probability weighs each expert's output instead of its activation
(the same sum, rounded once in fp32). Counted in ``local_calls`` (a call's trace: ``LOCAL_EXPERTS_KEY``).

Legend: ``T`` tokens, ``E`` experts, ``K`` experts per token, ``S = T * K`` rows, ``D`` features.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from actorcore.kernels.moe_permute import ExpertOrder, combine, permute, sort_by_expert
from actorcore.mcore.build.fused_ops import compiled
from actorcore.mcore.build.grouped_experts import QUACK, SEQUENTIAL, GroupedExperts, SequentialMLP
from actorcore.mcore.build.normed_projection import LentNormInput, use_norm_recomputing_router

try:  # megatron-core is optional; this module is only imported after require_megatron()
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
except ImportError:  # pragma: no cover - guarded by require_megatron
    MoELayer = MoEAlltoAllTokenDispatcher = torch.nn.Module  # type: ignore[misc,assignment]

GATHER_DISPATCH_KEY = "mcore:gather_dispatch"  # MoE layer forwards whose dispatcher permuted by gathers
LOCAL_EXPERTS_KEY = "mcore:local_experts"  # MoE layer forwards that ran their experts without the dispatcher


def gather_dispatch_refusal(config: Any) -> str | None:
    """Why megatron-core's own dispatcher permutations stay (None: the gather-only ones run)."""
    checks = (
        (config.moe_token_dispatcher_type == "alltoall", f"the {config.moe_token_dispatcher_type} dispatcher"),
        (config.moe_expert_capacity_factor is None and not config.moe_pad_expert_input_to_capacity,
         "expert capacity (dropped or padded tokens)"),
        (not config.moe_router_padding_for_quantization, "router padding for quantization"),
        (not config.moe_permute_fusion, "Transformer Engine's fused permutation"),
    )
    return next((what for ok, what in checks if not ok), None)


def chosen_experts(routing_map_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, K]``: the experts a routing map marks for each token, ascending."""
    return torch.sort(routing_map_TE.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :top_k]


def expert_order(routing_map_TE: torch.Tensor, top_k: int) -> ExpertOrder:
    """The rows of a routing map (``K`` experts marked per token) sorted by expert, tokens ascending within one:
    megatron-core's permutation order."""
    return sort_by_expert(chosen_experts(routing_map_TE, top_k), routing_map_TE.shape[1])


def local_routing(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    """``(weights [T, K], token_of_row, pair_of_row, row_of_pair, expert_of_row, offsets)``: each token's routing
    probabilities of its chosen experts and the order of its rows (a function of tensors, compiled as one region)."""
    chosen_TK = chosen_experts(routing_map_TE, top_k)
    return (probs_TE.gather(1, chosen_TK), *sort_by_expert(chosen_TK, routing_map_TE.shape[1]))


def local_experts_refusal(layer: Any) -> str | None:
    """Why this MoE layer's experts run through its token dispatcher (None: they run on the tokens directly)."""
    dispatcher, config = layer.token_dispatcher, layer.config
    checks = (
        (isinstance(dispatcher, GatherTokenDispatcher), "megatron-core's own dispatcher permutations"),
        (isinstance(layer.experts, GroupedExperts) and layer.experts.kernel == QUACK, "experts not on quack's GEMMs"),
        (dispatcher.ep_size == 1 and dispatcher.tp_size == 1, "experts split over ranks (EP or expert TP > 1)"),
        (not layer.shared_expert_overlap, "shared experts overlapped with the dispatch"),
        (not layer.moe_layer_recompute, "megatron-core's MoE-layer recompute"),
        (not config.moe_latent_size, "MoE latent projections"),
    )
    return next((what for ok, what in checks if not ok), None)


def _permute_rows(x_TD: torch.Tensor, token_of_row: torch.Tensor, row_of_pair: torch.Tensor) -> torch.Tensor:
    return permute(x_TD, ExpertOrder(token_of_row, None, row_of_pair, None, None))


def _sum_rows(rows_SD: torch.Tensor, token_of_row: torch.Tensor, pair_of_row: torch.Tensor,
              row_of_pair: torch.Tensor) -> torch.Tensor:
    ones_TK = torch.ones(row_of_pair.shape, dtype=torch.float32, device=rows_SD.device)
    return combine(rows_SD, ones_TK, ExpertOrder(token_of_row, pair_of_row, row_of_pair, None, None), rows_SD.dtype)


class GatherTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """``MoEAlltoAllTokenDispatcher`` whose local permutations are gathers (``kernels.moe_permute``); compiled
    (one kernel each way instead of a gather, a cast and an add per slot) when the layers are (``fused``)."""

    fused = False
    dispatches = 0  # the gather-only dispatches this dispatcher ran (a call's trace: GATHER_DISPATCH_KEY)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.dispatches += 1
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        self.order = order = expert_order(routing_map, self.config.moe_router_topk)
        experts = routing_map.shape[1]
        permuted_probs = probs.reshape(-1).index_select(0, order.token_of_row * experts + order.expert_of_row)
        permute_rows = compiled(_permute_rows) if self.fused else _permute_rows
        return permute_rows(hidden_states, order.token_of_row, order.row_of_pair), permuted_probs

    def combine_postprocess(self, permutated_local_input_tokens: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()
        order, self.order = self.order, None
        sum_rows = compiled(_sum_rows) if self.fused else _sum_rows
        output = sum_rows(permutated_local_input_tokens, order.token_of_row, order.pair_of_row, order.row_of_pair)
        output = output.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output


class GatherMoELayer(MoELayer, LentNormInput):
    """``MoELayer`` with ``GatherTokenDispatcher`` (where ``gather_dispatch_refusal`` passes), and its experts on the
    tokens directly where ``local_experts_refusal`` passes. Fused with local experts, no shared experts and
    megatron-core's router, the router and the experts can keep the pre-MLP norm's input instead of its output when
    the layer lends it (``LentNormInput``; ``mcore/build/normed_projection.py``)."""

    local_calls = 0  # the forwards that ran the experts without the dispatcher (a call's trace: LOCAL_EXPERTS_KEY)

    def __init__(self, *args: Any, fused: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused = fused
        if type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher and gather_dispatch_refusal(self.config) is None:
            self.token_dispatcher.__class__ = GatherTokenDispatcher
            self.token_dispatcher.fused = fused
        self.local_experts = local_experts_refusal(self) is None
        self.recomputes_norm_input = fused and self.local_experts and self.shared_experts is None \
            and use_norm_recomputing_router(self.router)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        if not self.local_experts or intermediate_tensors is not None or hidden_states.numel() == 0:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        self.local_calls += 1
        if padding_mask is not None:  # as MoELayer.forward: [bsz, seq] to the hidden states' [seq, bsz]
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared = self.shared_experts_compute(hidden_states)
        origin = self.lent_origin(hidden_states) if self.recomputes_norm_input else None
        router_calls = self.router.recomputing_calls if origin is not None else 0
        with self.router.normed_from(hidden_states, origin) if origin is not None else contextlib.nullcontext():
            probs, routing_map = self.route(hidden_states, padding_mask)
        routing = compiled(local_routing) if self.fused else local_routing
        weights, *order = routing(probs, routing_map, self.config.moe_router_topk)
        output = self.experts.forward_tokens(hidden_states.reshape(-1, hidden_states.shape[-1]), weights,
                                             ExpertOrder(*order), x_from=origin).view(hidden_states.shape)
        if origin is not None and self.router.recomputing_calls > router_calls:
            self.recomputing_calls += 1  # the router and the experts both kept the norm's input
        return (output if shared is None else output + shared), None


def with_grouped_experts(layer_spec: Any, kernel: str | None, fused: bool) -> Any:
    """A layer spec whose MoE experts are ``GroupedExperts`` running ``kernel``, in a ``GatherMoELayer`` (dense
    layers and ``"sequential"`` / None: unchanged)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    mlp = layer_spec.submodules.mlp
    if kernel in (None, SEQUENTIAL) or not isinstance(mlp, ModuleSpec) or mlp.module is not MoELayer:
        return layer_spec
    experts = mlp.submodules.experts
    if experts.module is not SequentialMLP:
        raise ValueError(f"the MoE layer spec builds {experts.module.__name__} experts, not megatron-core's local "
                         "SequentialMLP, which the grouped experts replace: pass moe_experts='sequential'")
    experts = dataclasses.replace(experts, module=GroupedExperts, params={**experts.params, "kernel": kernel,
                                                                          "fused": fused})
    # the dispatcher's local permutations as gathers, where it covers them (gather_dispatch_refusal)
    mlp = dataclasses.replace(mlp, module=GatherMoELayer, params={**mlp.params, "fused": fused},
                              submodules=dataclasses.replace(mlp.submodules, experts=experts))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))
