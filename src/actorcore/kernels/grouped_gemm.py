"""Grouped GEMMs over rows sorted by expert: torch's ``grouped_mm`` where it runs, one GEMM per expert elsewhere.

Legend: ``S`` rows sorted by expert, ``E`` experts (groups), ``I`` input features, ``O`` output features.

Why: a mixture-of-experts layer multiplies each expert's rows by that expert's weight. One GEMM per expert in a
Python loop launches ``E`` small kernels per projection (and its two gradients), which on the H200 left the
Megatron route's MoE step mostly waiting on the host; torch's ``grouped_mm`` runs every group in one launch
(a CUTLASS kernel for bf16 on Hopper; torch's own per-group fallback for the other dtypes and chips).

Where: torch's ``grouped_mm`` (``torch.nn.functional.grouped_mm``, else ``torch._grouped_mm``) takes bf16, fp16 and
fp32 rows and weights of one dtype whose row strides and data are 16-byte aligned (torch 2.13's CPU kernel refuses
the others, measured); on CUDA it needs compute capability 8.0 or newer. Elsewhere ``grouped_linear`` runs the same
product one expert at a time (the offsets read on the host once). Both give the same values on the CPU in fp32
(measured bitwise at the tiny test shapes). torch's own backward of ``grouped_mm`` refuses an expanded output
gradient (``y.sum().backward()``, measured on the CPU kernel), so the backward here makes it contiguous first and
calls ``grouped_mm`` itself for both gradients (the weight's in its k-grouped form).

The weights may come as each expert's own tensor (Megatron keeps one ``nn.Linear`` per expert): they are stacked in
forward and again in backward, never kept stacked in between; where they lie one after the other in memory
(``consecutive``) the stack is a view, read in place, else a copy (the memory of one layer's experts, for the
duration of one GEMM).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _torch_grouped_mm() -> Callable | None:
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _aligned(t: torch.Tensor) -> bool:
    """Data and every non-unit stride 16-byte aligned (what torch's grouped GEMM kernels load)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


def grouped_mm_refusal(x_SI: torch.Tensor, weight_EOI: torch.Tensor) -> str | None:
    """Why torch's ``grouped_mm`` cannot multiply these rows by these ``[E, out, in]`` weights here (None: it can)."""
    if _torch_grouped_mm() is None:
        return f"torch {torch.__version__} has no grouped_mm"
    if x_SI.dtype not in _DTYPES or weight_EOI.dtype != x_SI.dtype:
        return f"grouped_mm takes bf16, fp16 or fp32 rows and weights of one dtype, got {x_SI.dtype} and {weight_EOI.dtype}"
    if x_SI.is_cuda and torch.cuda.get_device_capability(x_SI.device) < (8, 0):
        return "grouped_mm needs a CUDA GPU of compute capability 8.0 or newer"
    if x_SI.device.type not in ("cuda", "cpu"):
        return f"grouped_mm is used on CUDA and CPU tensors only, got {x_SI.device.type}"
    if not (_aligned(x_SI) and _aligned(weight_EOI)):
        return "grouped_mm needs 16-byte aligned data and row strides (widths that are multiples of 16 bytes)"
    return None


def _loop_grouped_mm(x_SI: torch.Tensor, weight_EIO: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``grouped_mm``'s product one group at a time (rows ``[offsets[e-1], offsets[e])`` times ``weight[e]``)."""
    out = x_SI.new_zeros(x_SI.shape[0], weight_EIO.shape[-1])
    start = 0
    for expert, end in enumerate(offsets_E.tolist()):
        if end > start:
            torch.mm(x_SI[start:end], weight_EIO[expert], out=out[start:end])
        start = end
    return out


def _loop_weight_grad(x_SI: torch.Tensor, grad_SO: torch.Tensor, offsets_E: torch.Tensor, experts: int
                      ) -> torch.Tensor:
    """``[E, O, I]``: each group's ``grad^T @ x`` (zero for a group without rows)."""
    out = x_SI.new_zeros(experts, grad_SO.shape[-1], x_SI.shape[-1])
    start = 0
    for expert, end in enumerate(offsets_E.tolist()):
        if end > start:
            torch.mm(grad_SO[start:end].t(), x_SI[start:end], out=out[expert])
        start = end
    return out


def consecutive(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors are contiguous, of one shape and dtype, and lie one after the other in one storage."""
    first = tensors[0]
    if not first.is_contiguous():
        return False
    storage, offset, numel = first.untyped_storage().data_ptr(), first.storage_offset(), first.numel()
    return all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype
               and t.untyped_storage().data_ptr() == storage and t.storage_offset() == offset + i * numel
               for i, t in enumerate(tensors))


def stack_experts(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[E, ...]`` of the experts' tensors (no autograd): a view where they are ``consecutive``, else a copy."""
    first = tensors[0].detach()
    if consecutive(tensors):
        return first.as_strided((len(tensors), *first.shape), (first.numel(), *first.stride()), first.storage_offset())
    return torch.stack([t.detach() for t in tensors])


def _weights(stacked_or_list: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return stacked_or_list[0] if len(stacked_or_list) == 1 and stacked_or_list[0].dim() == 3 \
        else stack_experts(stacked_or_list)


class _GroupedLinear(torch.autograd.Function):
    """``y[s] = x[s] @ weight[e(s)]^T`` for the rows ``s`` of each expert ``e`` (``offsets``: end rows, int32).
    ``weights``: one ``[E, O, I]`` tensor, or each expert's ``[O, I]`` (stacked here in forward and again in
    backward, so no stacked copy is kept between them: a view where they are consecutive in memory)."""

    @staticmethod
    def forward(ctx, x_SI, offsets_E, use_torch, *weights):
        ctx.save_for_backward(x_SI, offsets_E, *weights)
        weight_EOI = _weights(weights)
        ctx.use_torch = use_torch
        if use_torch:
            return _torch_grouped_mm()(x_SI, weight_EOI.transpose(-2, -1), offs=offsets_E)
        return _loop_grouped_mm(x_SI, weight_EOI.transpose(-2, -1), offsets_E)

    @staticmethod
    def backward(ctx, grad_SO):
        x_SI, offsets_E, *weights = ctx.saved_tensors
        weight_EOI = _weights(tuple(weights))
        grad_SO = grad_SO.contiguous()
        grad_x = grad_w = None
        if x_SI.shape[0] == 0:  # no rows (an expert-parallel rank without tokens): nothing flows back
            grad_x = torch.zeros_like(x_SI) if ctx.needs_input_grad[0] else None
            grad_w = torch.zeros_like(weight_EOI) if any(ctx.needs_input_grad[3:]) else None
        elif ctx.use_torch:
            mm = _torch_grouped_mm()
            if ctx.needs_input_grad[0]:
                grad_x = mm(grad_SO, weight_EOI, offs=offsets_E)
            if any(ctx.needs_input_grad[3:]):
                grad_w = mm(grad_SO.t(), x_SI, offs=offsets_E)  # k-grouped: [E, O, I]
        else:
            if ctx.needs_input_grad[0]:
                grad_x = _loop_grouped_mm(grad_SO, weight_EOI, offsets_E)
            if any(ctx.needs_input_grad[3:]):
                grad_w = _loop_weight_grad(x_SI, grad_SO, offsets_E, weight_EOI.shape[0])
        grads_w = (None,) * len(weights) if grad_w is None else (grad_w,) if len(weights) == 1 and \
            weights[0].dim() == 3 else grad_w.unbind(0)
        return (grad_x, None, None, *grads_w)


def grouped_linear(x_SI: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor], offsets_E: torch.Tensor
                   ) -> torch.Tensor:
    """``[S, O]``: each row through its expert's linear. ``weight``: ``[E, out, in]`` (as ``nn.Linear`` stores its
    weight), or each expert's ``[out, in]`` (their gradients go back to each); ``offsets_E``: the end row of each
    expert's group (int32, non-decreasing, the last ``== S``)."""
    weights = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
    stacked = _weights(weights)
    if x_SI.dim() != 2 or stacked.dim() != 3 or x_SI.shape[1] != stacked.shape[2]:
        raise ValueError(f"grouped_linear takes rows [S, in] and weights [E, out, in], got {tuple(x_SI.shape)} and "
                         f"{tuple(stacked.shape)}")
    if offsets_E.shape != (stacked.shape[0],):
        raise ValueError(f"offsets must hold one end row per expert ({stacked.shape[0]}), got {tuple(offsets_E.shape)}")
    use_torch = grouped_mm_refusal(x_SI, stacked) is None
    return _GroupedLinear.apply(x_SI, offsets_E.to(device=x_SI.device, dtype=torch.int32), use_torch, *weights)


def group_offsets(rows_per_group_E: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """The int32 end row of each group (``grouped_mm``'s ``offs``) from the rows of each group, on ``device``."""
    counts = torch.as_tensor(rows_per_group_E, dtype=torch.int64)
    return torch.cumsum(counts, 0).to(device=device, dtype=torch.int32, non_blocking=True)
