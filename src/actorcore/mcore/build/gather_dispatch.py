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

Legend: ``T`` tokens, ``E`` experts, ``K`` experts per token, ``S = T * K`` rows, ``D`` features.
"""

from __future__ import annotations

from typing import Any

import torch

from actorcore.kernels.moe_permute import ExpertOrder, combine, permute, sort_by_expert
from actorcore.mcore.build.fused_ops import compiled

try:  # megatron-core is optional; this module is only imported after require_megatron()
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
except ImportError:  # pragma: no cover - guarded by require_megatron
    MoELayer = MoEAlltoAllTokenDispatcher = torch.nn.Module  # type: ignore[misc,assignment]

GATHER_DISPATCH_KEY = "mcore:gather_dispatch"  # MoE layer forwards whose dispatcher permuted by gathers


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


def expert_order(routing_map_TE: torch.Tensor, top_k: int) -> ExpertOrder:
    """The rows of a routing map (``K`` experts marked per token) sorted by expert, tokens ascending within one:
    megatron-core's permutation order."""
    chosen_TK = torch.sort(routing_map_TE.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :top_k]
    return sort_by_expert(chosen_TK, routing_map_TE.shape[1])


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


class GatherMoELayer(MoELayer):
    """``MoELayer`` with ``GatherTokenDispatcher`` (where ``gather_dispatch_refusal`` passes)."""

    def __init__(self, *args: Any, fused: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher and gather_dispatch_refusal(self.config) is None:
            self.token_dispatcher.__class__ = GatherTokenDispatcher
            self.token_dispatcher.fused = fused
