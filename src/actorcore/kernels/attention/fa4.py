"""FlashAttention-4 (``flash-attn-4``: FlashAttention's CuTe DSL kernels) as a packed-attention backend on Hopper.

Legend: ``T`` packed tokens, ``N`` query heads, ``K`` key/value heads, ``H`` head dim.

Why: torch's ``varlen_attn`` runs FlashAttention-2 kernels, well under half of an H200's matmul rate; FA4's SM90
kernels use Hopper's asynchronous tensor-core instructions (the FlashAttention-3 class), forward and backward, with
``cu_seqlens`` for packed sequences.

How: two custom ops, ``actorcore::fa4_varlen_forward`` and ``actorcore::fa4_varlen_backward``, joined by
``register_autograd``. Eager calls and the compiled decoder's compiled layers run the same ops: Dynamo sees one opaque
op with a fake implementation (FA4 compiles its kernels with the CuTe DSL on first use, which no graph can hold).
The ops call ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``, the entry points flash-attn-4's
own autograd function calls. They are not its public API and change between its beta releases, so only the tested
release is taken (``fa4_refusal``).

What it covers (read from flash-attn-4 4.0.0b36's SM90 path; each proven per element on the GPU by
``tests/gpu/test_fa4_attention_cuda.py``): causal attention within each segment, grouped-query heads, sliding
windows, logit softcapping, attention sinks (a learned logit per query head in every softmax denominator, with its
gradient), fp16 / bf16, one head dim for q, k and v (the caller pads unequal ones) among ``HEAD_DIMS``, the ones
proven exact on the GPU. Not covered: attention dropout, fp32, GPUs other than Hopper (the only ones it was run on).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from typing import Any, Optional

import torch

from actorcore.kernels.quack import runtime as quack_runtime

FA4_VERSION = "4.0.0b36"
INSTALL_HINT = (f"pip install 'actorcore[fa4]' (flash-attn-4=={FA4_VERSION} over quack-kernels 0.6.4 and the "
                "nvidia-cutlass-dsl 4.6.2 it pins; nvidia-cutlass-dsl[cu13] on CUDA 13)")
FA4_DTYPES = (torch.float16, torch.bfloat16)
# The head dims FA4 is taken for: those proven per element against fp32 on Hopper (forward and the three gradients,
# tests/gpu/test_fa4_attention_cuda.py; H100, 2026-12-06). Its kernels take 8-256 in steps of 8, but at head dim 16
# the HF route's gradients through FA4 were 1.29 (relative norm) from fp32 against FA2's 0.011 on the same model,
# while its forward agreed: a head dim is added here only once it is measured exact.
HEAD_DIMS = (64, 128, 256)
HOPPER = 9  # the compute capability major FA4 is taken on
# What FA4 is taken for besides plain causal attention, read from flash-attn-4 4.0.0b36's SM90 path; a feature that
# tests/gpu/test_fa4_attention_cuda.py shows wrong on the GPU is removed here, and such calls fall back (or are refused
# when FA4 is asked for by name) with the reason.
FA4_FEATURES = frozenset({"window", "softcap", "sinks"})

# The names of the ops as a captured graph's nodes show them (``holds_packed_attention``).
FORWARD_OP_NAME = "actorcore.fa4_varlen_forward"


@functools.cache
def installed_refusal() -> str | None:
    """Why flash-attn-4 cannot be imported and called here (None: it can): the tested release, over quack and the
    CuTe DSL quack pins (FA4 builds its kernels from quack's helpers), on a Hopper-or-newer GPU."""
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return f"flash-attn-4 is not installed ({INSTALL_HINT})"
    if version != FA4_VERSION:
        return (f"flash-attn-4 {version} is installed; actorcore calls its forward and backward entry points, which "
                f"change between its beta releases, and takes only the tested {FA4_VERSION} ({INSTALL_HINT})")
    if importlib.util.find_spec("flash_attn.cute") is None:
        return f"flash-attn-4 is installed but flash_attn.cute cannot be found ({INSTALL_HINT})"
    return quack_runtime.quack_refusal()


def fa4_refusal(device: torch.device, dtype: torch.dtype, head_dim: int, capability: tuple[int, int] | None, *,
                dropout: float = 0.0, window: bool = False, softcap: bool = False, sinks: bool = False) -> str | None:
    """Why FA4 cannot run attention with these arguments (None: it can). ``head_dim``: the one head dim the kernel
    sees (the larger of q/k's and v's); ``capability``: the device's compute capability (None off CUDA); ``window``,
    ``softcap``, ``sinks``: whether the call has them (``FA4_FEATURES``)."""
    if device.type != "cuda" or capability is None:
        return "FA4 runs on CUDA devices only"
    if capability[0] != HOPPER:
        return f"FA4 is taken on Hopper (sm90) only, the GPUs it was tested on; this device is sm{capability[0]}" \
               f"{capability[1]}"
    if dtype not in FA4_DTYPES:
        return f"FA4 takes fp16 / bf16 inputs, not {dtype}"
    if head_dim not in HEAD_DIMS:
        return (f"FA4 is taken for the head dims proven exact on the GPU, {', '.join(map(str, HEAD_DIMS))}, not "
                f"{head_dim} (fa4.HEAD_DIMS)")
    if dropout:
        return "FA4 has no attention dropout (set the model's attention_dropout to 0.0 for training)"
    missing = [name for name, used in (("window", window), ("softcap", softcap), ("sinks", sinks))
               if used and name not in FA4_FEATURES]
    if missing:
        return f"FA4 is not taken for attention with {', '.join(missing)} (not in fa4.FA4_FEATURES)"
    return installed_refusal()


def fa4_varlen_attention(q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, scale: float, sliding_window: int | None = None,
                         softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each segment of ``cu_seqlens`` on FA4's kernels; ``[T, N, H]`` in the input dtype.
    q, k and v share one head dim (callers pad, see ``varlen._with_equal_head_dims``). Traceable by Dynamo: it calls
    only the custom op (``max_seqlen`` may be symbolic)."""
    cu = cu_seqlens.to(torch.int32)
    out, _ = torch.ops.actorcore.fa4_varlen_forward(q_TNH, k_TKH, v_TKH, cu, max_seqlen, float(scale),
                                                    sliding_window or None, float(softcap or 0.0), sinks)
    return out


def _interface() -> Any:
    """flash-attn-4's interface module, imported on first use (it imports the CuTe DSL)."""
    return importlib.import_module("flash_attn.cute.interface")


def _window_left(window: Optional[int]) -> Optional[int]:
    """A window of ``w`` tokens (query ``i`` sees ``j`` iff ``0 <= i - j < w``) as FA4's left extent; None: the
    whole causal prefix (FA4 reads -1 with no right extent as a window, so None is passed, not -1)."""
    return None if window is None else window - 1


@torch.library.custom_op("actorcore::fa4_varlen_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                scale: float, window: Optional[int], softcap: float, sinks: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, N, H], lse [N, T] fp32)`` of FA4's varlen forward (causal, softcap 0.0: none), contiguous."""
    out, lse = _interface()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        softmax_scale=scale, causal=True, softcap=softcap, window_size_left=_window_left(window),
        window_size_right=None, learnable_sink=sinks, return_lse=True)[:2]
    return out.contiguous(), lse.contiguous()


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens, max_seqlen, scale, window, softcap, sinks):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("actorcore::fa4_varlen_backward", mutates_args=())
def _backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float, window: Optional[int],
                 softcap: float, sinks: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)`` of FA4's varlen backward; ``dsinks`` is empty without sinks."""
    grads = _interface()._flash_attn_bwd(
        q, k, v, out, grad_out.contiguous(), lse, scale, True, softcap, window_size_left=_window_left(window),
        window_size_right=None, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, learnable_sink=sinks)
    dsinks = grads[3] if sinks is not None else q.new_empty(0)
    # Contiguous, as the fake implementation promises a compiled graph (FA4 allocates them like its inputs).
    return grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous(), dsinks.contiguous()


@_backward_op.register_fake
def _backward_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window, softcap, sinks):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale, window, softcap, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, sinks)
    ctx.max_seqlen, ctx.scale, ctx.window, ctx.softcap = max_seqlen, scale, window, softcap


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.actorcore.fa4_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens,
                                                                 ctx.max_seqlen, ctx.scale, ctx.window, ctx.softcap,
                                                                 sinks)
    return dq, dk, dv, None, None, None, None, None, None if sinks is None else dsinks


_forward_op.register_autograd(_backward, setup_context=_setup_context)
