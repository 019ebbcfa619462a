"""Packed linear attention (Gated DeltaNet) for hybrid Hugging Face models: actorcore owns both recurrences.

Legend: ``L`` this rank's tokens, ``T`` all tokens of the (padded) packed batch, ``C`` conv channels, ``W`` conv
width, ``N`` / ``M`` key / value heads, ``n`` / ``m`` this rank's, ``K`` / ``V`` key / value head dims.

A Gated DeltaNet layer runs a short causal conv1d over its q/k/v channels and then the gated delta rule, a
recurrence over the tokens. Transformers keeps packed sequences apart in neither (its torch conv ignores
``cu_seq_lens_q``; its CUDA conv needs a ``seq_idx`` nothing passes), so restarted position ids alone would run
one sequence's state into the next without an error. For a packed call, each linear-attention module gets an
instance ``forward`` (a ``GatedDeltaNetForward`` object holding its module, so ``copy.deepcopy`` carries it to the
copy's weights) that uses the module's own projections, norm and output layer and actorcore's kernels
(``kernels.linear_attention``), which restart the conv and the delta-rule state at every ``cu_seq_lens_q``
boundary. The decoder installs it for one call (``packed_linear_attention``) and restores the module's forward
afterwards; ``patch_model`` installs it for good under Ulysses SP. Every call counts itself in the call's trace
(``"linear_attention:actorcore_packed"`` / ``"linear_attention:actorcore_ulysses"``): the decoder requires one per
linear-attention layer, so a transformers change that bypasses the module's ``forward`` is an error.

Ulysses SP: the heads of a Gated DeltaNet layer are independent, and so are its conv channels (depthwise). The
pre-conv q/k/v (key heads replicated to whole heads per rank when fewer than ``sp``, as for attention's kv heads),
the decay ``g`` and ``beta`` are exchanged from sequence-sharded to head-sharded; each rank convolves its heads'
channels (the conv weight's rows of those heads) over whole sequences and runs the delta rule on them; the output
is exchanged back and the gated norm and output projection run on the rank's own tokens.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from actorcore.archs import LinearAttentionSpec
from actorcore.errors import PackingNotAppliedError
from actorcore.hf.call import DecoderCall, parallel_from_kwargs, trace_from_kwargs
from actorcore.hf.features.base import DecoderFeature, switched_for_call
from actorcore.hf.features.instance_forwards import install_forwards
from actorcore.kernels.linear_attention.gated_deltanet import (decay_and_beta, gated_norm_recomputed, in_projections,
                                                               mix_packed)
from actorcore.kernels.linear_attention.packed import causal_conv1d_packed, gated_delta_rule_packed
from actorcore.parallel.ulysses import (
    head_to_sequence_sharded,
    heads_of_rank,
    replicate_kv_heads,
    sequence_to_head_sharded,
    valid_sp_sizes,
)

PACKED_LINEAR = "actorcore_packed"
ULYSSES_LINEAR = "actorcore_ulysses"


def linear_trace_key(implementation: str) -> str:
    return f"linear_attention:{implementation}"


LINEAR_TRACE_KEYS = (linear_trace_key(PACKED_LINEAR), linear_trace_key(ULYSSES_LINEAR))


def check_linear_heads(modules: list[torch.nn.Module], sp_size: int) -> None:
    """Refuse an SP size the linear-attention heads cannot split over (value heads as attention's query heads,
    key heads as its kv heads), naming the sizes that work."""
    for module in modules:
        heads, key_heads = int(module.num_v_heads), int(module.num_k_heads)
        if sp_size not in valid_sp_sizes(heads, key_heads):
            raise ValueError(
                f"Ulysses sequence parallelism cannot split the linear-attention (Gated DeltaNet) layers' {heads} "
                f"value heads and {key_heads} key heads over sp_size={sp_size}: value heads must divide evenly and "
                "key heads must divide evenly or be replicated into whole heads. Valid sp sizes for these layers: "
                f"{valid_sp_sizes(heads, key_heads)}"
            )


def _project(module: torch.nn.Module, projections: str, hidden_1LD: torch.Tensor):
    """``(pre-conv q/k/v channels [L, C], z [L, M, V], b [L, M], a [L, M])`` as the module's forward builds them."""
    return in_projections(projections, lambda name: getattr(module, name)(hidden_1LD)[0], module.num_k_heads,
                          module.num_v_heads, module.head_k_dim, module.head_v_dim)


class GatedDeltaNetForward:
    """The instance ``forward`` of one Gated DeltaNet module for packed calls (see the module docstring).

    An object holding its module, not a closure, so a deep copy of the model computes with the copy's weights.
    """

    def __init__(self, module: torch.nn.Module, projections: str, previous: Any) -> None:
        self.module = module
        self.projections = projections
        self.previous = previous  # an instance forward that was there before, else None (the class's)

    def __call__(self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
                 cache_params: Any = None, **kwargs: Any) -> torch.Tensor:
        m = self.module
        if cache is not None or cache_params is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(f"{type(m).__name__}: actorcore's packed linear attention keeps no cache (training and "
                             "scoring); generate with the model's own forward outside actorcore's calls")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(f"{type(m).__name__} got a padding mask: actorcore's packed batches have no padding")
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None:
            raise PackingNotAppliedError(
                f"{type(m).__name__} runs actorcore's packed linear attention but the call carries no cu_seq_lens_q; "
                "call the model through actorcore.compute_logprobs / compute_values / compute_loss (a model patched "
                "for Ulysses SP cannot run a plain forward; handle.revert() restores it)")
        if hidden_states.shape[0] != 1:
            raise ValueError(f"packed linear attention expects batch size 1 (all sequences packed), got "
                             f"{hidden_states.shape[0]}")
        ctx = parallel_from_kwargs(kwargs)
        sp = 1 if ctx is None else int(ctx.sp_size)
        trace = trace_from_kwargs(kwargs)
        if trace is not None:
            trace[linear_trace_key(ULYSSES_LINEAR if sp > 1 else PACKED_LINEAR)] += 1
        L = hidden_states.shape[1]
        mixed_LC, z_LMV, b_LM, a_LM = _project(m, self.projections, hidden_states)
        g_LM, beta_LM = decay_and_beta(a_LM, b_LM, m.A_log, m.dt_bias)
        if sp == 1:
            out_LMV = self._packed(mixed_LC, g_LM, beta_LM, cu_seqlens, trace)
        else:
            out_LMV = self._ulysses(mixed_LC, g_LM, beta_LM, cu_seqlens, ctx, trace)
        V = m.head_v_dim
        out = gated_norm_recomputed(m.norm, out_LMV.reshape(-1, V), z_LMV.reshape(-1, V)).reshape(1, L, -1)
        return m.out_proj(out)

    def _split_channels(self, x_LC: torch.Tensor, key_heads: int, value_heads: int):
        m = self.module
        L = x_LC.shape[0]
        q, k, v = torch.split(x_LC, [key_heads * m.head_k_dim, key_heads * m.head_k_dim, value_heads * m.head_v_dim],
                              dim=-1)
        return q.reshape(L, key_heads, -1), k.reshape(L, key_heads, -1), v.reshape(L, value_heads, -1)

    def _packed(self, mixed_LC, g_LM, beta_LM, cu_seqlens, trace):
        m = self.module
        return mix_packed(mixed_LC, g_LM, beta_LM, m.conv1d.weight[:, 0], m.conv1d.bias, m.activation, cu_seqlens,
                          m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, trace)

    def _ulysses(self, mixed_LC, g_LM, beta_LM, cu_seqlens, ctx, trace):
        m = self.module
        sp, group, rank = int(ctx.sp_size), ctx.sp_group, int(ctx.sp_rank)
        L = mixed_LC.shape[0]
        if not cu_seqlens.is_cuda and int(cu_seqlens[-1]) != L * sp:
            raise ValueError(f"cu_seq_lens_q covers {int(cu_seqlens[-1])} tokens but {sp} ranks hold {L} each; pass "
                             "the full padded batch's cu_seqlens (compute_logprobs does)")
        N, M, K = m.num_k_heads, m.num_v_heads, m.head_k_dim
        q_LNK, k_LNK, v_LMV = self._split_channels(mixed_LC, N, M)
        # One exchange for q and k (same heads), one for v, one for the per-value-head g and beta (fp32; beta's
        # model-dtype values are exact in fp32 and cast back).
        qk_TnX = sequence_to_head_sharded(replicate_kv_heads(torch.cat([q_LNK, k_LNK], dim=-1), sp), group, sp)
        v_TmV = sequence_to_head_sharded(v_LMV, group, sp)
        gb_Tm2 = sequence_to_head_sharded(torch.stack([g_LM, beta_LM.float()], dim=-1), group, sp)
        T, n = qk_TnX.shape[:2]
        W = m.conv1d.weight.shape[-1]
        weight_CW = m.conv1d.weight[:, 0]
        wq, wk, wv = self._split_channels(weight_CW.T, N, M)  # [W, heads, dim] per part
        parts = [heads_of_rank(w.permute(1, 2, 0), sp, rank).reshape(-1, W) for w in (wq, wk, wv)]
        bias = m.conv1d.bias
        if bias is not None:
            bq, bk, bv = self._split_channels(bias[None], N, M)
            bias = torch.cat([heads_of_rank(b[0], sp, rank).reshape(-1) for b in (bq, bk, bv)])
        x_TC = torch.cat([qk_TnX[..., :K].reshape(T, -1), qk_TnX[..., K:].reshape(T, -1), v_TmV.reshape(T, -1)], -1)
        conv_TC = causal_conv1d_packed(x_TC, torch.cat(parts), bias, cu_seqlens, m.activation, trace=trace)
        q, k, v = self._split_channels(conv_TC, n, v_TmV.shape[1])
        out_TmV = gated_delta_rule_packed(q, k, v, gb_Tm2[..., 0], gb_Tm2[..., 1].to(beta_LM.dtype), cu_seqlens,
                                          use_qk_l2norm=True, trace=trace)
        return head_to_sequence_sharded(out_TmV, group, sp)


def is_installed(module: torch.nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), GatedDeltaNetForward)


def install_linear_forwards(modules: list[torch.nn.Module], spec: LinearAttentionSpec) -> Any:
    """Give each module a ``GatedDeltaNetForward``; returns the undo (restores exactly what was there)."""
    _, restore = install_forwards(modules, lambda module, previous: GatedDeltaNetForward(module, spec.projections,
                                                                                          previous))
    return restore


@contextlib.contextmanager
def packed_linear_attention(modules: list[torch.nn.Module], spec: LinearAttentionSpec) -> Iterator[None]:
    """``install_linear_forwards`` for the duration of a block (one packed call, or its recomputation)."""
    restore = install_linear_forwards(modules, spec)
    try:
        yield
    finally:
        restore()


class LinearAttention(DecoderFeature):
    """Hybrid models' Gated DeltaNet layers: actorcore's packed forward for the call (one process) or for the
    patch's lifetime (Ulysses SP); ``check`` requires one trace count per linear-attention layer."""

    name = "linear_attention"
    after = ("activation_offload",)

    def install(self, handle: Any) -> None:
        modules = handle.parts.linear_modules
        if handle.state.sp_size == 1 or not modules:
            return
        if any(is_installed(m) for m in modules):
            raise ValueError("this model's linear-attention modules already run actorcore's packed forward although "
                             "the model is not patched; revert the other patch (or build a fresh model) first")
        handle.add_undo(install_linear_forwards(modules, handle.spec.linear_attention))

    def active(self, call: DecoderCall) -> bool:
        return bool(call.parts.linear_modules)

    def enter(self, call: DecoderCall) -> contextlib.AbstractContextManager:
        modules = call.parts.linear_modules
        if all(is_installed(m) for m in modules):
            return contextlib.nullcontext()
        return switched_for_call(call.parts.decoder, functools.partial(packed_linear_attention, modules,
                                                                      call.spec.linear_attention))

    def check(self, call: DecoderCall) -> None:
        ran, layers = call.ran(*LINEAR_TRACE_KEYS), len(call.parts.linear_modules)
        if ran < layers:
            raise PackingNotAppliedError(
                f"packed linear attention ran {ran} times for {layers} linear-attention layers: the installed "
                "transformers bypassed actorcore's linear attention (its conv and delta-rule state would run across "
                "sequences); refusing to return unpacked results")
