"""The Gated DeltaNet mixer's arithmetic between its projections, shared by the Hugging Face and Megatron routes.

Legend: ``T`` packed tokens, ``C`` conv channels (``[q; k; v]``), ``n`` / ``m`` key / value heads (of this rank),
``K`` / ``V`` key / value head dims. What transformers' Qwen3-Next / Qwen3.5 module computes after its
in-projections: the decay and write strength, the depthwise causal conv over the q/k/v channels, the gated delta rule
(q and k L2-normalised) and the gated RMSNorm; both recurrences restart at every boundary of ``cu_seqlens``.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from actorcore.kernels.linear_attention.packed import causal_conv1d_packed, gated_delta_rule_packed


def in_projections(projections: str, project: Callable[[str], torch.Tensor], n: int, m: int, K: int, V: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q/k/v channels [T, C], z [T, m, V], b [T, m], a [T, m])`` of a Gated DeltaNet layer, as transformers' module
    builds them, from its in-projections (both routes: ``project(name)`` is the ``[T, width]`` output of the layer's
    projection of that name, for ``n`` / ``m`` key / value heads). ``projections``: ``"separate"`` (Qwen3.5:
    ``in_proj_qkv`` [q; k; v], ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) or ``"grouped"`` (Qwen3-Next:
    ``in_proj_qkvz`` and ``in_proj_ba`` grouped per key head, ``split_grouped_projections``)."""
    if projections == "grouped":
        return split_grouped_projections(project("in_proj_qkvz"), project("in_proj_ba"), n, m, K, V)
    mixed_TC = project("in_proj_qkv")
    T = mixed_TC.shape[0]
    return (mixed_TC, project("in_proj_z").reshape(T, m, V), project("in_proj_b").reshape(T, m),
            project("in_proj_a").reshape(T, m))


def split_grouped_projections(qkvz_TX: torch.Tensor, ba_TY: torch.Tensor, n: int, m: int, K: int, V: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in-projections, grouped per key head (``[q_h, k_h, v and z of its m/n value heads]`` and
    ``[b, a]`` of them) -> ``(q/k/v channels [T, C], z [T, m, V], b [T, m], a [T, m])``."""
    T, per = qkvz_TX.shape[0], m // n
    q, k, v, z = torch.split(qkvz_TX.reshape(T, n, 2 * K + 2 * per * V), [K, K, per * V, per * V], dim=2)
    b, a = torch.split(ba_TY.reshape(T, n, 2 * per), [per, per], dim=2)
    mixed_TC = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    return mixed_TC, z.reshape(T, m, V), b.reshape(T, m), a.reshape(T, m)


def decay_and_beta(a_Tm: torch.Tensor, b_Tm: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)``: the log-decay ``-exp(A_log) * softplus(a + dt_bias)`` in fp32 (as the module computes it) and
    the write strength ``sigmoid(b)``."""
    return -A_log.float().exp() * F.softplus(a_Tm.float() + dt_bias), b_Tm.sigmoid()


def mix_packed(mixed_TC: torch.Tensor, g_Tm: torch.Tensor, beta_Tm: torch.Tensor, conv_weight_CW: torch.Tensor,
               conv_bias: torch.Tensor | None, activation: str | None, cu_seqlens: torch.Tensor, n: int, m: int,
               K: int, V: int, trace: Counter | None = None) -> torch.Tensor:
    """The causal conv over the q/k/v channels, then the gated delta rule: ``[T, m, V]``."""
    T = mixed_TC.shape[0]
    conv_TC = causal_conv1d_packed(mixed_TC, conv_weight_CW, conv_bias, cu_seqlens, activation, trace=trace)
    q, k, v = torch.split(conv_TC, [n * K, n * K, m * V], dim=-1)
    return gated_delta_rule_packed(q.reshape(T, n, K), k.reshape(T, n, K), v.reshape(T, m, V), g_Tm, beta_Tm,
                                   cu_seqlens, use_qk_l2norm=True, trace=trace)


def gated_norm_recomputed(norm: Callable[..., torch.Tensor], x: torch.Tensor, gate: torch.Tensor, *args
                          ) -> torch.Tensor:
    """``norm(x, gate, *args)``, recomputed in its own backward when recording gradients (the same values): the
    gated RMSNorm in torch keeps about four fp32 ``[tokens * m, V]`` tensors for its backward (some 5 GiB per layer
    for 159K tokens of Qwen3.5-2B); checkpointed, it keeps its two 16-bit inputs."""
    if torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad):
        return torch.utils.checkpoint.checkpoint(norm, x, gate, *args, use_reentrant=False)
    return norm(x, gate, *args)
