"""Exact routed-expert gradients at TP > 1 with EP = 1 (expert tensor parallelism is 1 on the Megatron route).

actorcore keeps every expert whole on its expert-parallel rank (``expert_tensor_parallel_size=1``). At TP > 1
the MoE layer runs under sequence parallelism, so with EP = 1 each TP rank routes only its own ``T / tp``
tokens through its full copy of the experts: its expert gradient is that share. Megatron's expert data
parallel group (``parallel_state.get_expert_data_parallel_group()``: the ranks holding the same experts, here
the TP ranks times DP) is the group that must sum them, but megatron-core 0.16.1 marks expert parameters for it
(``param.allreduce = False``) only when ``expert_model_parallel_size > 1``; at EP = 1 they count as dense and its
DDP reduces them over data parallel only (it assumes expert TP equals TP, its default). Measured on gloo at
TP=2 x EP=1 (Qwen3-MoE, after DDP + ``finalize_model_grads``): each rank's expert gradient was 70-98% off
transformers', their sum over TP equal. ``mark_experts_expert_data_parallel`` sets Megatron's own flag on those
parameters, as Megatron sets it at EP > 1, so its DDP (and its optimizer's expert parameter groups and grad
norm) treat them over the expert data parallel group; nothing else changes.
"""

from __future__ import annotations

from typing import Any


def mark_experts_expert_data_parallel(chunk: Any) -> None:
    """Mark (Megatron's ``allreduce = False``) the routed-expert parameters of ``chunk`` when their expert data
    parallel group is wider than the data parallel group (EP = 1, expert TP < TP); elsewhere Megatron's own
    marking is right and nothing changes."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    config = chunk.config
    if config.expert_model_parallel_size > 1 or config.expert_tensor_parallel_size >= config.tensor_model_parallel_size:
        return
    for module in chunk.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():
                param.allreduce = False
