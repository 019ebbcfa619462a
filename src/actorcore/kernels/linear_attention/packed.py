"""Linear attention over packed variable-length sequences: the two recurrences of a Gated DeltaNet layer.

Legend: ``T`` packed tokens, ``C`` channels, ``W`` conv kernel width, ``N`` key heads (q and k), ``M`` value
heads (``M % N == 0``: each key head serves ``M / N`` consecutive value heads), ``K`` key head dim, ``V``
value head dim, ``B`` sequences.

Both functions restart at every boundary of ``cu_seqlens``: nothing of one sequence reaches the next.
- ``causal_conv1d_packed``: a depthwise causal convolution (``out[t] = sum_s w[:, W-1-s] * x[t-s]`` over the
  taps that stay inside ``t``'s own sequence), plus bias and activation.
- ``gated_delta_rule_packed``: the gated delta rule, state ``S`` (``[K, V]`` per value head) starting at zero in
  every sequence: ``S = exp(g_t) S``, ``S += k_t (beta_t (v_t - S^T k_t))^T``, ``o_t = S^T q_t`` (q scaled by
  ``K^-0.5``, q and k L2-normalised when asked), computed in fp32 chunk by chunk (chunks of 64) as transformers' torch
  reference does, every sequence of the pack at once (one recurrence step per chunk index); the torch backend runs
  ``delta_rule_chunks.delta_rule_blocks`` (blocks of steps, a hand-written backward that holds one block at a time).
Backends: ``torch`` (any device; the plain reference) and ``fla`` (flash-linear-attention's Triton kernels with
``cu_seqlens``; CUDA, when installed, imported lazily). ``auto`` picks ``fla`` on CUDA when it is installed.
Each call counts its backend in ``trace`` under ``"causal_conv1d:<backend>"`` / ``"gated_delta_rule:<backend>"``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections import Counter

import torch
import torch.nn.functional as F

from actorcore.kernels.linear_attention.delta_rule_chunks import delta_rule_blocks, positions_in_sequence
from actorcore.kernels.trace import add

BACKENDS = ("auto", "torch", "fla")
ACTIVATIONS = (None, "silu", "swish")


@functools.cache
def has_fla() -> bool:
    return importlib.util.find_spec("fla") is not None


def fla_delta_rule_refusal(device: torch.device) -> str | None:
    """Why fla's gated delta rule cannot train here, or None. fla 0.6 itself refuses its backward on Hopper with
    Triton >= 3.4 and < 3.7.1 (wrong gradients, fla issue #640) unless tilelang is installed; measured on the
    H200 with Triton 3.6: the RuntimeError comes only in backward, after the forward has run."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    if importlib.util.find_spec("tilelang") is not None or importlib.util.find_spec("triton") is None:
        return None
    import triton

    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if (3, 4) <= version < (3, 7, 1):
        return (f"fla's gated delta rule backward is wrong on Hopper with Triton {triton.__version__} (fla #640); "
                "install Triton >= 3.7.1 or tilelang")
    return None


def _choose(backend: str, device: torch.device, delta_rule_needs_grad: bool = False) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear-attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        if device.type != "cuda" or not has_fla():
            return "torch"
        return "torch" if delta_rule_needs_grad and fla_delta_rule_refusal(device) else "fla"
    if backend == "fla" and device.type != "cuda":
        raise ValueError("the fla backend runs on CUDA only; use backend='torch' on the CPU")
    return backend


def _check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor of B + 1 offsets, got shape {tuple(cu_seqlens.shape)}")
    if not cu_seqlens.is_cuda and int(cu_seqlens[-1]) != num_tokens:  # no device sync on the GPU path
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but there are {num_tokens} tokens")


def causal_conv1d_packed(
    x_TC: torch.Tensor,
    weight_CW: torch.Tensor,
    bias_C: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    activation: str | None = None,
    *,
    backend: str = "auto",
    trace: Counter[str] | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d restarting at every sequence boundary; ``[T, C]`` in ``x``'s dtype.

    Computed in the weight's dtype (as transformers' torch path); ``activation``: ``None``, ``"silu"``/``"swish"``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d_packed supports activations {ACTIVATIONS}, got {activation!r}")
    T, C = x_TC.shape
    if weight_CW.dim() != 2 or weight_CW.shape[0] != C:
        raise ValueError(f"conv weight must be [C={C}, W], got {tuple(weight_CW.shape)}")
    _check_cu_seqlens(cu_seqlens, T)
    backend = _choose(backend, x_TC.device)
    add(trace, f"causal_conv1d:{backend}")
    if backend == "fla":
        from fla.modules.causal_conv1d import causal_conv1d

        out, _ = causal_conv1d(x_TC.unsqueeze(0).to(weight_CW.dtype).contiguous(), weight_CW.contiguous(), bias_C,
                               activation=activation, cu_seqlens=cu_seqlens.long())
        return out[0].to(x_TC.dtype)
    return _conv_torch(x_TC, weight_CW, bias_C, cu_seqlens, activation)


def _conv_torch(x_TC, weight_CW, bias_C, cu_seqlens, activation):
    T, W = x_TC.shape[0], weight_CW.shape[1]
    x = x_TC.to(weight_CW.dtype)
    pos_T1 = positions_in_sequence(cu_seqlens, T).unsqueeze(1)
    out = x * weight_CW[:, W - 1]
    for s in range(1, W):  # tap s reads the token s steps back, if it is in the same sequence
        if s >= T:
            break
        back = F.pad(x[: T - s], (0, 0, s, 0))
        out = out + torch.where(pos_T1 >= s, back, 0.0) * weight_CW[:, W - 1 - s]
    if bias_C is not None:
        out = out + bias_C
    if activation is not None:
        out = F.silu(out)
    return out.to(x_TC.dtype)


def gated_delta_rule_packed(
    q_TNK: torch.Tensor,
    k_TNK: torch.Tensor,
    v_TMV: torch.Tensor,
    g_TM: torch.Tensor,
    beta_TM: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    trace: Counter[str] | None = None,
) -> torch.Tensor:
    """The gated delta rule over packed sequences, state reset at each boundary; ``[T, M, V]`` in q's dtype.

    ``g`` is the log decay (``<= 0``), ``beta`` the write strength; both per token and value head.
    """
    T, N, K = q_TNK.shape
    M = v_TMV.shape[1]
    if k_TNK.shape != q_TNK.shape or v_TMV.shape[0] != T or g_TM.shape != (T, M) or beta_TM.shape != (T, M):
        raise ValueError(f"gated_delta_rule_packed: shapes q {tuple(q_TNK.shape)}, k {tuple(k_TNK.shape)}, v "
                         f"{tuple(v_TMV.shape)}, g {tuple(g_TM.shape)}, beta {tuple(beta_TM.shape)} do not agree "
                         "(q, k: [T, N, K]; v: [T, M, V]; g, beta: [T, M])")
    if M % N:
        raise ValueError(f"{M} value heads cannot share {N} key heads evenly")
    _check_cu_seqlens(cu_seqlens, T)
    scale = K**-0.5 if scale is None else scale
    needs_grad = torch.is_grad_enabled() and any(
        x.requires_grad for x in (q_TNK, k_TNK, v_TMV, g_TM, beta_TM))
    backend = _choose(backend, q_TNK.device, delta_rule_needs_grad=needs_grad)
    add(trace, f"gated_delta_rule:{backend}")
    if backend == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k, v, g, beta = (x.unsqueeze(0).contiguous() for x in (q_TNK, k_TNK, v_TMV, g_TM, beta_TM))
        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm,
                                        cu_seqlens=cu_seqlens.long())
        return out[0].to(q_TNK.dtype)
    return delta_rule_blocks(q_TNK, k_TNK, v_TMV, g_TM, beta_TM, cu_seqlens, use_qk_l2norm, scale,
                             out_dtype=q_TNK.dtype)
