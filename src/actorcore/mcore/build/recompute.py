"""Budgeted activation recompute for the Megatron route (``build_gpt_model(..., recompute=..., memory_budget_gib=...)``).

Each decoder layer of a forward-backward call runs in one of three modes (``mcore/build/layer.py`` applies them):

- ``"none"``: nothing recomputed (every activation kept);
- ``"selective"``: the layer under PyTorch's selective activation checkpoint with actorcore's policy
  (``kernels.selective_checkpoint``: the outputs of the GEMMs, grouped GEMMs and attention kernels kept, the
  elementwise work recomputed in backward);
- ``"full"``: the layer under torch's non-reentrant checkpoint (its whole forward again in backward).

Requests: ``None`` (the default) keeps every layer; ``"full"`` / ``"selective"`` put every layer in that mode;
``"auto"`` plans each call within ``memory_budget_gib``: as many of the LAST layers as fit run ``"selective"`` and
the others ``"full"`` (backward reaches the last layers first, so their kept activations are freed first); where
every layer fits selectively, as many of the last as fit keep everything (``"none"``: no recompute at all). A
layer's bytes per token are estimated from the config until a CUDA call has measured what the layer kept
(``LayerPlan.measured``, kept on the handle), then the measurement plans (a layer not yet run in a mode plans with
the measurement of a layer built alike: a selectively recomputed layer's unrecomputed bytes are those a kept layer
of its kind measured). The planner is ``kernels.selective_checkpoint.layers_to_keep``, the kept-or-full case of the
HF route's ``cheapest_plan``. The recomputed kernels see the same inputs, so the gradients are bitwise those of
``"full"`` (and of no recompute) wherever the kernels are deterministic.

Megatron's own recompute options (``recompute_granularity``) do the same by other means and are refused beside
these. Dropout must be off: a recompute would draw other masks (Megatron's tracker states are not replayed).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from actorcore.kernels.selective_checkpoint import layers_to_keep

RECOMPUTE_MODES = ("full", "selective", "auto")
NONE, SELECTIVE, FULL = "none", "selective", "full"
FULL_KEY = "mcore:recompute_full_layers"  # layer forwards run under a full checkpoint
SELECTIVE_KEY = "mcore:recompute_selective_layers"  # layer forwards run under a selective checkpoint
KEPT_KEY = "mcore:recompute_kept_layers"  # layer forwards of a training call that kept every activation
SLACK_BYTES = 2**30  # beside the planned layers: the head's chunk workspace, allocator rounding
MEASURE_MARGIN = 1.05  # on a measured layer's bytes: packs of other lengths


@dataclass(frozen=True)
class RecomputePlan:
    """What the model was built with: a mode and, for ``"auto"``, the budget in bytes."""

    mode: str
    budget_bytes: float | None = None


def check_recompute(mode: Any, memory_budget_gib: Any) -> RecomputePlan | None:
    """The plan of ``build_gpt_model(recompute=mode, memory_budget_gib=...)``; refuses what does not fit together."""
    if mode is None:
        if memory_budget_gib is not None:
            raise ValueError("memory_budget_gib is the budget of recompute='auto'; pass recompute='auto'")
        return None
    if mode not in RECOMPUTE_MODES or not isinstance(mode, str):
        raise ValueError(f"recompute must be None, 'full', 'selective' or 'auto', got {mode!r}")
    if mode != "auto":
        if memory_budget_gib is not None:
            raise ValueError(f"memory_budget_gib is only used by recompute='auto', not {mode!r}")
        return RecomputePlan(mode)
    if isinstance(memory_budget_gib, bool) or not isinstance(memory_budget_gib, (int, float)) or not (
            math.isfinite(memory_budget_gib) and memory_budget_gib > 0):
        raise ValueError(f"recompute='auto' needs memory_budget_gib, a positive number of GiB, got "
                         f"{memory_budget_gib!r}")
    return RecomputePlan(mode, float(memory_budget_gib) * 2**30)


def check_recompute_config(plan: RecomputePlan | None, config: Any) -> None:
    """Refuse recompute beside Megatron's own, or with dropout (a recompute would draw other masks)."""
    if plan is None:
        return
    if config.recompute_granularity is not None:
        raise ValueError(f"recompute={plan.mode!r} and Megatron's recompute_granularity="
                         f"{config.recompute_granularity!r} both recompute the layers: keep one (actorcore's "
                         "recompute plans per call within memory_budget_gib)")
    dropout = {name: getattr(config, name) for name in ("hidden_dropout", "attention_dropout")
               if getattr(config, name)}
    if dropout:
        raise ValueError(f"recompute={plan.mode!r} with dropout ({dropout}): a recomputed layer would draw other "
                         "dropout masks than its forward did; set the dropout to 0 (RL fine-tuning runs without) or "
                         "pass recompute=None")


@dataclass
class LayerPlan:
    """One call's plan, handed to every layer with the micro-batch (``BatchParams.layer_plan``): each layer's mode
    (by module id; absent: ``"none"``) and index, this rank's tokens of the largest micro-batch, the call's own
    trace (added to the caller's ``caller_trace`` after the call), the forwards each grouped experts module ran in
    the call, and what each kept layer was measured to hold (bytes per token by ``(layer index, mode)``, filled by
    CUDA calls; the handle's dict, so later calls plan with it)."""

    modes: dict[int, str] = field(default_factory=dict)
    index: dict[int, int] = field(default_factory=dict)
    tokens: int = 0
    trace: Counter = field(default_factory=Counter)
    caller_trace: Counter | None = None
    experts_ran: dict[int, int] = field(default_factory=dict)
    measured: dict[tuple[int, str], float] = field(default_factory=dict)

    def mode_of(self, layer: Any) -> str:
        return self.modes.get(id(layer), NONE)

    def count(self, key: str) -> None:
        self.trace[key] += 1

    def record(self, layer: Any, mode: str, held_bytes: int) -> None:
        """What ``layer`` held after its forward in ``mode`` (allocator bytes), per token, with a margin."""
        index = self.index.get(id(layer))
        if index is None or not self.tokens:
            return
        per_token = max(0.0, held_bytes / self.tokens) * MEASURE_MARGIN
        self.measured[(index, mode)] = max(per_token, self.measured.get((index, mode), 0.0))


def moe_block_bytes_per_token(config: Any, element_bytes: int, local_experts: bool = False) -> float:
    """The MoE block's part of ``layer_bytes_per_token``'s estimate without recompute: its experts' and the router's
    kept bytes per token."""
    kept, more = _mlp_widths(config, True, local_experts)
    return float((kept + more) * element_bytes + 8 * config.num_moe_experts)


def _attention_widths(config: Any) -> tuple[int, int]:
    """(query width, key + value width) of one attention layer's projections."""
    if config.multi_latent_attention:
        q = config.num_attention_heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)
        return q, q + config.num_attention_heads * config.v_head_dim
    return config.num_attention_heads * config.kv_channels, 2 * config.num_query_groups * config.kv_channels


def _mlp_widths(config: Any, moe: bool, local_experts: bool = False) -> tuple[int, int]:
    """(kept by the selective policy, kept beside it without recompute) per token of one layer's MLP."""
    if not moe:
        inner = config.ffn_hidden_size
        return 2 * inner + config.hidden_size, 3 * inner
    k, inner, d = config.moe_router_topk, config.moe_ffn_hidden_size, config.hidden_size
    shared = config.moe_shared_expert_intermediate_size or 0
    shared_kept = 2 * shared + d if shared else 0
    if local_experts:
        # quack's gated GEMMs on the tokens themselves: each token's K gate/up rows (SwiGLU in the epilogues), the
        # combined output, the routing's weights and row indices (one more hidden width covers them); no dispatched
        # rows, no separate activation. Measured on the Qwen3-30B-A3B shape (H100, router included): 30.0 KB per
        # token, this estimate 33.8 KB; the dispatcher's estimate was 123 KB
        return k * 2 * inner + 2 * d + shared_kept, 3 * shared
    # the experts' GEMM outputs and the dispatcher's rows in and out; unrecomputed: the activation's inputs and output
    kept = k * (2 * inner + 3 * d) + shared_kept
    return kept, k * 3 * inner + 3 * shared


def layer_bytes_per_token(config: Any, element_bytes: int, moe: bool, local_experts: bool = False
                          ) -> tuple[float, float, float]:
    """Estimated activation bytes per token of one decoder layer: (kept without recompute, kept by the selective
    checkpoint, the checkpointed layer's own input). From the config's widths; errs on the large side.
    ``local_experts``: the MoE layer's tokens go to its experts without the dispatcher (``GatherMoELayer``)."""
    d = config.hidden_size
    q, kv = _attention_widths(config)
    mlp_kept, mlp_more = _mlp_widths(config, moe, local_experts)
    selective = (q + kv) + q + d + mlp_kept
    unrecomputed = selective + 2 * d + (q + kv) + mlp_more  # the norms' inputs and outputs, RoPE's, the activation's
    fp32 = 4 * config.num_attention_heads + (8 * config.num_moe_experts if moe else 0)  # log-sum-exps, router scores
    return float(unrecomputed * element_bytes + fp32), float(selective * element_bytes + fp32), float(d * element_bytes)


def plan_layer_modes(plan: RecomputePlan, per_layer: list[tuple[float, float, float]], tokens: int, in_flight: int,
                     allocated_bytes: float, measured: dict[tuple[int, str], float] | None = None,
                     kinds: list | None = None, grads_from: list[float] | None = None) -> list[str]:
    """Each layer's mode for one call. ``per_layer``: ``layer_bytes_per_token`` of this rank's layers in order;
    ``tokens``: this rank's tokens of the largest micro-batch; ``in_flight``: micro-batches whose activations are
    alive at once (pipeline warm-up); ``measured``: bytes per token measured for ``(layer, mode)``; ``kinds``: a
    key per layer, equal for layers built alike (``layer_kind``), whose measurements stand in for each other;
    ``grads_from``: per layer, the weight gradients not yet allocated that exist by its backward
    (``call_plan.gradients_from``; a call of one micro-batch allocates them as its backward goes)."""
    layers = len(per_layer)
    if plan.mode == FULL:
        return [FULL] * layers
    if plan.mode == SELECTIVE:
        return [SELECTIVE] * layers
    measured = measured or {}
    scale = tokens * in_flight
    none = [_layer_bytes(measured, kinds, i, NONE, b[0]) * scale for i, b in enumerate(per_layer)]
    selective = [_layer_bytes(measured, kinds, i, SELECTIVE, b[1]) * scale for i, b in enumerate(per_layer)]
    base = allocated_bytes + sum(b[2] for b in per_layer) * scale + SLACK_BYTES
    keep = layers_to_keep(plan.budget_bytes, base, selective, grads_from)
    if keep < layers:
        return [FULL] * (layers - keep) + [SELECTIVE] * keep
    for unrecomputed in range(layers, 0, -1):  # every layer fits selectively: keep all of the last ones that fit
        if layers_to_keep(plan.budget_bytes, base, selective[:layers - unrecomputed] + none[layers - unrecomputed:],
                          grads_from) == layers:
            return [SELECTIVE] * (layers - unrecomputed) + [NONE] * unrecomputed
    return [SELECTIVE] * layers


def _layer_bytes(measured: dict[tuple[int, str], float], kinds: list | None, index: int, mode: str,
                 estimate: float) -> float:
    """Layer ``index``'s bytes per token in ``mode``: its own measurement, else the largest measured in that mode for
    a layer of its kind (a layer planned selectively is never measured unrecomputed until it runs so; a layer built
    alike keeps the same), else the config's estimate."""
    if (index, mode) in measured:
        return measured[(index, mode)]
    if kinds is not None:
        alike = [value for (other, m), value in measured.items()
                 if m == mode and other < len(kinds) and kinds[other] == kinds[index]]
        if alike:
            return max(alike)
    return estimate


def micro_batches_in_flight(pp: int, pp_rank: int, vp: int | None, micro_batches: int) -> int:
    """Micro-batches whose activations a pipeline stage holds at once: one without pipelining, ``pp - rank`` in the
    1F1B schedule's warm-up, at most ``pp x vp`` with virtual stages (an upper bound)."""
    if pp == 1:
        return 1
    return min(micro_batches, pp * vp if vp else pp - pp_rank)
