"""Tiled MLP: run a token-wise function shard by shard, keeping no intermediates, recomputing in backward.

Legend: ``T`` tokens (leading dims flattened), ``D`` input features, ``E`` output features.

An MLP acts on each token independently, so its ``[T, I]`` intermediates (``I`` = intermediate size, often
4-8x the hidden size) never need to exist for all tokens at once. ``tiled_mlp`` runs ``forward_fn`` on one
token shard at a time under ``no_grad``, and in backward recomputes each shard with grad and differentiates
it. Outputs and input gradients are the untiled ones bit for bit (rows are independent); parameter
gradients are the per-shard gradients summed in shard order (in at least float32).

The function knows nothing about models: it takes the callable and the parameters it reads. Under FSDP2 the
callable must be the module's plain forward (not ``module(...)``), so it reads the parameters FSDP has
unsharded for this module; those same parameter objects must be passed as ``params`` so autograd routes their
gradients (FSDP2 keeps one unsharded parameter object per weight, so forward and backward see the same ones).
``forward_fn`` must be deterministic (no dropout): backward recomputes it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


# Shard boundaries fall on multiples of this many tokens. CPU elementwise kernels compute whole vector
# blocks and a tail with slightly different math (e.g. GELU-tanh); aligned shards see the same blocks as one
# untiled call, so fp64 outputs stay bitwise equal. (A no-op concern on GPUs.)
TOKEN_ALIGNMENT = 16


def shard_bounds(num_tokens: int, shards: int, alignment: int = TOKEN_ALIGNMENT) -> list[tuple[int, int]]:
    """``[start, end)`` of each non-empty shard: at most ``shards`` of them, every boundary but the last on
    a multiple of ``alignment`` (``shards`` need not divide ``num_tokens``)."""
    per_shard = -(-num_tokens // shards)
    per_shard = max(alignment, -(-per_shard // alignment) * alignment)
    return [(start, min(start + per_shard, num_tokens)) for start in range(0, num_tokens, per_shard)]


def _run_shards(forward_fn: Callable, x_TD: torch.Tensor, shards: int) -> torch.Tensor:
    return torch.cat([forward_fn(x_TD[a:b]) for a, b in shard_bounds(x_TD.shape[0], shards)])


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward_fn: Callable, shards: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.forward_fn = forward_fn
        ctx.shards = shards
        ctx.save_for_backward(x, *params)
        out_TE = _run_shards(forward_fn, x.reshape(-1, x.shape[-1]), shards)
        return out_TE.reshape(*x.shape[:-1], out_TE.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        need_params = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        x_TD = x.detach().reshape(-1, x.shape[-1])
        grad_TE = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x_TD = torch.empty_like(x_TD) if need_x else None
        sums: dict[int, torch.Tensor] = {}
        for a, b in shard_bounds(x_TD.shape[0], ctx.shards):
            with torch.enable_grad():
                x_shard = x_TD[a:b].detach().requires_grad_(need_x)
                y_shard = ctx.forward_fn(x_shard)
            wrt = ([x_shard] if need_x else []) + [params[i] for i in need_params]
            grads = list(torch.autograd.grad(y_shard, wrt, grad_TE[a:b], allow_unused=True))
            if need_x:
                grad_x_TD[a:b] = grads.pop(0)
            for i, g in zip(need_params, grads):
                if g is None:
                    continue
                g = g.to(torch.promote_types(g.dtype, torch.float32))
                sums[i] = g if i not in sums else sums[i] + g
        for i in need_params:
            if i not in sums:
                raise RuntimeError(
                    f"tiled_mlp: parameter {i} (shape {tuple(params[i].shape)}) got no gradient from the recomputed "
                    "forward; the forward reads different parameter objects than the ones passed (e.g. it calls "
                    "module(...) under FSDP instead of the plain forward)"
                )
        grad_params = [sums[i].to(params[i].dtype) if i in sums else None for i in range(len(params))]
        grad_x = grad_x_TD.reshape(x.shape) if need_x else None
        return (None, None, grad_x, *grad_params)


def tiled_mlp(forward_fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, shards: int,
              params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """``forward_fn(x)`` computed over ``shards`` token shards of ``x`` (all dims but the last are tokens).

    ``params``: every tensor ``forward_fn`` reads that needs a gradient (the module's parameters).
    """
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    params = tuple(params)
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    if not wants_grad:
        out_TE = _run_shards(forward_fn, x.reshape(-1, x.shape[-1]), shards)
        return out_TE.reshape(*x.shape[:-1], out_TE.shape[-1])
    return _TiledMLPFunction.apply(forward_fn, shards, x, *params)
