"""A Gated DeltaNet layer for Megatron's local layer spec that runs packed (THD) batches.

Legend: ``T`` packed tokens, ``C`` this rank's conv channels (``[q; k; v]``), ``W`` conv width, ``n`` / ``m`` this
rank's key / value heads, ``K`` / ``V`` key / value head dims, ``D`` hidden.

megatron-core 0.16.1 has a ``GatedDeltaNet``, but it refuses packed sequences (and needs flash-linear-attention);
actorcore's route always runs packed batches. ``PackedGatedDeltaNet`` takes the place of a layer's self-attention
in the layers that ``TransformerConfig.linear_attention_freq`` marks (1 = linear attention) and computes what
transformers' Qwen3-Next / Qwen3.5 module computes: in-projections, a depthwise causal conv1d over the q/k/v
channels with SiLU, the gated delta rule (q and k L2-normalised), a gated RMSNorm per value head and the output
projection. The two recurrences run through ``kernels.linear_attention`` (torch reference, or flash-linear-attention
on CUDA), which restart both the conv and the delta-rule state at every boundary of the batch's ``cu_seqlens``:
nothing of one sequence reaches the next.

Tensor parallelism is over heads: each rank holds ``n = N / tp`` key heads and the ``m = M / tp`` value heads they
serve (column-parallel in-projections, the conv's channels and the decay parameters of those heads; a row-parallel
out-projection). The in-projections keep transformers' parameter names and layouts, per ``projections``:
``"separate"`` (Qwen3.5: ``in_proj_qkv`` [q; k; v], ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) or ``"grouped"``
(Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba`` grouped per key head). The gated norm's weight (one value head,
replicated) has different heads' inputs on each rank: its gradient is summed over TP in the backward itself.

Context parallelism is refused: the conv and the delta-rule state cross the CP chunks of a sequence.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from actorcore.archs.spec import LINEAR_PROJECTIONS
from actorcore.errors import PackingNotAppliedError
from actorcore.kernels.linear_attention.gated_deltanet import (decay_and_beta, gated_norm_recomputed, in_projections,
                                                               mix_packed)

try:  # megatron-core is optional; this module is only imported by mcore/build/model.py after require_megatron()
    from megatron.core.transformer.module import MegatronModule
except ImportError:  # pragma: no cover - guarded by require_megatron
    MegatronModule = torch.nn.Module  # type: ignore[misc,assignment]


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``RMSNormGated``: normalise in fp32, scale in the input dtype, times ``silu(gate)`` in fp32."""
    dtype = x.dtype
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * normed) * F.silu(gate.float())).to(dtype)


class PackedGatedDeltaNet(MegatronModule):
    """Gated DeltaNet mixer over packed sequences (see the module docstring); returns ``(output, bias)`` as
    Megatron's attention modules do."""

    def __init__(self, config: Any, layer_number: int, projections: str = "separate", pg_collection: Any = None,
                 cp_comm_type: Any = None, **_: Any) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                          set_tensor_model_parallel_attributes)

        super().__init__(config)
        if projections not in LINEAR_PROJECTIONS:
            raise ValueError(f"projections must be one of {LINEAR_PROJECTIONS}, got {projections!r}")
        if config.context_parallel_size > 1:
            raise ValueError("Gated DeltaNet (linear-attention) layers do not run under context parallelism: the "
                             "causal conv and the delta-rule state cross the CP chunks of a sequence; use cp=1")
        self.layer_number = layer_number
        self.projections = projections
        self.tp_group = pg_collection.tp if pg_collection is not None else ps.get_tensor_model_parallel_group()
        tp = self.tp_group.size()
        N, M = config.linear_num_key_heads, config.linear_num_value_heads
        K, V = config.linear_key_head_dim, config.linear_value_head_dim
        if M % N or N % tp:
            raise ValueError(f"linear attention: {M} value heads over {N} key heads split over tp={tp} needs "
                             f"value heads a multiple of key heads and key heads divisible by tp")
        self.n, self.m, self.K, self.V = N // tp, M // tp, K, V
        self.eps = config.layernorm_epsilon
        D = config.hidden_size
        self.trace: Counter[str] | None = None  # kernel counts of the calls (tests set it)

        def column(out_features: int) -> Any:
            return ColumnParallelLinear(D, out_features, config=config, init_method=config.init_method, bias=False,
                                        gather_output=False, skip_bias_add=True, tp_group=self.tp_group)

        if projections == "separate":
            self.in_proj_qkv = column(2 * N * K + M * V)
            self.in_proj_z = column(M * V)
            self.in_proj_b = column(M)
            self.in_proj_a = column(M)
        else:
            self.in_proj_qkvz = column(2 * N * K + 2 * M * V)
            self.in_proj_ba = column(2 * M)
        channels = 2 * self.n * K + self.m * V
        dtype = config.params_dtype
        # Plain holders, so that the parameters keep transformers' names (conv1d.weight, norm.weight).
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(torch.empty(channels, 1, config.linear_conv_kernel_dim, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.m, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.m, dtype=dtype))
        for param in (self.conv1d.weight, self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(V, dtype=dtype))
        self.out_proj = RowParallelLinear(M * V, D, config=config, init_method=config.output_layer_init_method,
                                          bias=False, input_is_parallel=True, skip_bias_add=True,
                                          tp_group=self.tp_group)
        with torch.no_grad():
            torch.nn.init.uniform_(self.conv1d.weight, -(config.linear_conv_kernel_dim ** -0.5),
                                   config.linear_conv_kernel_dim ** -0.5)
            self.A_log.copy_(torch.empty(self.m).uniform_(1, 16).log())

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(q/k/v channels [T, C], z [T, m, V], b [T, m], a [T, m])`` for this rank's heads; under sequence
        parallelism the column-parallel projections gather the tokens, so ``T`` is the whole batch."""
        return in_projections(self.projections, lambda name: getattr(self, name)(hidden)[0].flatten(0, 1), self.n,
                              self.m, self.K, self.V)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, packed_seq_params: Any = None,
                **_: Any) -> tuple[torch.Tensor, None]:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        cu_seqlens = getattr(packed_seq_params, "cu_seqlens_q", None)
        if cu_seqlens is None or hidden_states.shape[1] != 1:
            raise PackingNotAppliedError(
                "PackedGatedDeltaNet runs packed (THD) batches only: it needs the batch's cu_seqlens "
                "(packed_seq_params) to restart the conv and the delta-rule state at every sequence; call the "
                "model through actorcore.mcore's compute_logprobs / compute_values")
        # Under sequence parallelism the column-parallel projections gather the tokens; T is the whole batch.
        mixed_TC, z_TmV, b_Tm, a_Tm = self._project(hidden_states)
        T = mixed_TC.shape[0]
        cu_seqlens = cu_seqlens.to(mixed_TC.device)
        g_Tm, beta_Tm = decay_and_beta(a_Tm, b_Tm, self.A_log, self.dt_bias)
        out_TmV = mix_packed(mixed_TC, g_Tm, beta_Tm, self.conv1d.weight[:, 0], None, "silu", cu_seqlens, self.n,
                             self.m, self.K, self.V, self.trace)
        weight = copy_to_tensor_model_parallel_region(self.norm.weight, group=self.tp_group)
        out = gated_norm_recomputed(gated_rms_norm, out_TmV, z_TmV, weight, self.eps).reshape(T, 1, self.m * self.V)
        output, bias = self.out_proj(out)
        return output, bias


    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None,
                           **_: Any) -> dict:
        """Megatron's distributed checkpoint: the per-head parameters split over TP along dim 0, and the
        ``[q; k; v]`` tensors (``conv1d.weight``, ``in_proj_qkv.weight``) stored as three tensors, so that a
        checkpoint saved at one TP size loads at another (as megatron-core's own GatedDeltaNet stores them)."""
        from megatron.core.ssm.gated_delta_net import _split_tensor_factory
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint,
                                                     sharded_state_dict_default)

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        common = dict(sharded_offsets=sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        own: dict = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0}, **common)
        for name, module in self.named_children():
            if name == "conv1d":
                out.update(make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True),
                                                               f"{prefix}conv1d.", {"weight": 0}, **common))
            else:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                      tp_group=self.tp_group))
        qkv = [self.n * self.K, self.n * self.K, self.m * self.V]
        for key in ("conv1d.weight", "in_proj_qkv.weight"):
            if f"{prefix}{key}" in out:
                out[f"{prefix}{key}"] = _split_tensor_factory(out[f"{prefix}{key}"], qkv, ["query", "key", "value"], 0)
        return out


def linear_attention_spec(projections: str) -> Any:
    """The ``ModuleSpec`` of a linear-attention layer's mixer (in the place of ``self_attention``)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=PackedGatedDeltaNet, params={"projections": projections})


def with_linear_attention_layers(block: Any, pattern: list[int], offset: int, projections: str) -> Any:
    """``block`` (this stage's ``TransformerBlockSubmodules``) with ``PackedGatedDeltaNet`` as the mixer of every
    layer that ``pattern`` (global layers, 1 = linear attention) marks; ``offset``: the stage's first layer."""
    import dataclasses

    mixer = linear_attention_spec(projections)
    layers = []
    for i, layer in enumerate(block.layer_specs):
        if pattern[offset + i]:
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules,
                                                                              self_attention=mixer))
        layers.append(layer)
    return dataclasses.replace(block, layer_specs=layers)
