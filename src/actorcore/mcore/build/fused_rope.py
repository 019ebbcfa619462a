"""RoPE inside the core attention, compiled, for the compiled Megatron layers (``compiled_layers``).

Why: Megatron's RoPE for packed (THD) batches without Transformer Engine (``rope_utils._apply_rotary_pos_emb_thd``)
reads the sequence lengths to the host (``cu_seqlens.tolist()``: a synchronisation, twice per layer), cuts the
frequencies per sequence and concatenates them, then runs a dozen memory-bound kernels over q and k (cos, sin, two
``torch.cat`` copies, multiplies, adds) forward and again backward. Here the per-token angles are made once per
micro-batch (gathers on the GPU, no synchronisation) and shared by every layer, and the rotation of q and k is one
compiled region (``fused_ops.rotary``) forward and backward.

How: the compiled layer (``mcore/build/layer.py``) hands Megatron's attention no rotary embedding and its core
attention (``PackedCoreAttention``) a ``RopeRequest`` in the micro-batch's ``BatchParams`` (``rope``); the core
attention rotates q and k before the kernel. Megatron applies RoPE at the same point (after the q/k norms, right
before the core attention), with the same math: the angles' cosine and sine times the YaRN scale, rounded to q's
dtype, then ``t * cos + rotate_half(t) * sin`` on the first ``R`` features (``R`` the frequencies' width), the rest
passed through. Within bf16 rounding of Megatron's eager RoPE (Inductor keeps fp32 between the multiply and the
add); in fp32 the same values up to the order of one multiply-add.

Where (``fused_rope_refusal``): megatron-core's ``SelfAttention`` with actorcore's ``PackedCoreAttention`` and no
context parallelism, rotate-half RoPE (not interleaved, not MLA, not Transformer Engine's fused RoPE), a THD batch
from actorcore's forward, one frequency tensor for q and k. Elsewhere Megatron's own RoPE runs.

Legend: ``T`` packed tokens, ``S`` positions Megatron computed frequencies for, ``R`` rotary width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

FUSED_ROPE_KEY = "mcore:fused_rope"  # layer forwards whose core attention applied RoPE compiled


@dataclass(frozen=True)
class RopeRequest:
    """What Megatron's attention would have rotated q and k by: its frequencies ``[S, 1, 1, R]`` and YaRN scale."""

    freqs: torch.Tensor
    mscale: float


@dataclass
class RopeAngles:
    """Per token: ``cos`` and ``sin`` ``[T, 1, R]`` in q's dtype (times the YaRN scale)."""

    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class RopeCache:
    """The angles of one micro-batch, made by the first layer and reused by the others (and by recompute)."""

    entries: dict = field(default_factory=dict)

    def angles(self, request: RopeRequest, cu_seqlens: torch.Tensor, tokens: int, dtype: torch.dtype) -> RopeAngles:
        key = (id(request.freqs), request.mscale, tokens, dtype)
        entry = self.entries.get(key)
        if entry is None:  # the frequencies are held with their angles, so their id is not reused meanwhile
            entry = (request.freqs, _angles(request, cu_seqlens, tokens, dtype))
            self.entries[key] = entry
        return entry[1]


def _angles(request: RopeRequest, cu_seqlens: torch.Tensor, tokens: int, dtype: torch.dtype) -> RopeAngles:
    """Megatron's per-token frequencies for a THD batch: the frequency rows themselves where there is one per token
    (M-RoPE), else each token's position within its sequence (``cu_seqlens``); then Megatron's rounding."""
    freqs_SR = request.freqs.reshape(request.freqs.shape[0], -1)
    if freqs_SR.shape[0] == tokens:
        freqs_TR = freqs_SR
    else:
        cu = cu_seqlens.to(device=freqs_SR.device, dtype=torch.long)
        index_T = torch.arange(tokens, device=freqs_SR.device)
        sequence_T = torch.searchsorted(cu[1:], index_T, right=True).clamp_(max=cu.numel() - 2)
        freqs_TR = freqs_SR[index_T - cu[sequence_T]]
    cos = (torch.cos(freqs_TR) * request.mscale).to(dtype)
    sin = (torch.sin(freqs_TR) * request.mscale).to(dtype)
    return RopeAngles(cos[:, None, :], sin[:, None, :])


def fused_rope_refusal(attention: Any, rotary_pos_emb: Any, packed_seq_params: Any) -> str | None:
    """Why this layer's RoPE stays Megatron's (None: the core attention applies it compiled)."""
    from megatron.core.transformer.attention import SelfAttention

    from actorcore.mcore.build.qk_norm import FusedQkNormAttention

    config = attention.config
    if isinstance(rotary_pos_emb, tuple):
        rotary_pos_emb = rotary_pos_emb[0] if rotary_pos_emb[0] is rotary_pos_emb[1] else None
    checks = (
        (type(attention) in (SelfAttention, FusedQkNormAttention),
         "attention other than megatron-core's SelfAttention"),
        (getattr(getattr(attention, "core_attention", None), "applies_rope", False),
         "a core attention other than actorcore's PackedCoreAttention"),
        (isinstance(rotary_pos_emb, torch.Tensor), "no RoPE, or other frequencies for q and k"),
        (getattr(packed_seq_params, "qkv_format", None) == "thd" and hasattr(packed_seq_params, "rope"),
         "a batch not packed by actorcore's forward"),
        (config.context_parallel_size == 1, "context parallelism"),
        (not config.rotary_interleaved and not config.multi_latent_attention, "interleaved RoPE or MLA"),
        (not config.apply_rope_fusion and not config.flash_decode, "Transformer Engine's fused RoPE"),
    )
    return next((what for ok, what in checks if not ok), None)


def rope_request(attention: Any, rotary_pos_emb: Any) -> RopeRequest:
    """The frequencies and YaRN scale Megatron's ``SelfAttention`` would apply (``fused_rope_refusal`` passed)."""
    from megatron.core.transformer import attention as megatron_attention

    freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
    return RopeRequest(freqs, float(megatron_attention._yarn_get_concentration_factor_from_config(attention.config)))
