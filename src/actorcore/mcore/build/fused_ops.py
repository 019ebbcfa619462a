"""The elementwise regions of a Megatron transformer layer as pure functions, eager or compiled by Inductor.

Legend: ``T`` tokens (this rank's), ``B`` = 1 (packed batches), ``D`` hidden, ``O`` an MLP's first projection width.

Why: between its GEMMs and attention a Megatron layer runs its norms, residual adds and gated activation as
separate memory-bound kernels, each reading and writing the whole ``[T, D]`` (or ``[T, O]``) tensor, several in
fp32; on the H200 they were a quarter of the Megatron route's MoE step (384 ms of elementwise kernels). Compiled,
each region is one or two fused kernels forward and backward. These are the regions ``mcore/build/layer.py``'s fused
layers (and ``mcore/build/grouped_experts.py``'s experts) run, written as Megatron's own modules compute them:

- ``residual_add``: Megatron's bias-dropout-add at dropout 0 (``x + bias``, then ``residual + x``, the residual cast
  to ``x``'s dtype);
- ``add_then_norm``: that add and the next norm (the attention output into the pre-MLP norm);
- ``apply_norm``: a norm module (RMSNorm in fp32 inside, as torch's and ``ZeroCenteredRMSNorm`` compute it);
- ``gated_activation`` / ``expert_activation``: ``MLP.forward``'s unfused activation (fc1's bias, the GLU with
  gpt-oss's clamp and linear offset), for experts times the routing probability in fp32, rounded once;
- ``rotary``: Megatron's rotate-half RoPE of q and k by per-token angles (``mcore/build/fused_rope.py``);
- ``qk_norms``: the q and k norms on views of the QKV projection (``mcore/build/qk_norm.py``).

``compiled(fn)`` is ``torch.compile(fn)`` with the token dim of its tensors marked dynamic: one compilation per
function for every pack length (the token count is symbolic) and every layer (modules are inputs, not constants of
the graph), the feature widths static, so Inductor's kernels index and reduce over constant widths
(``dynamic=True`` made them symbolic too: fc1's ``[gate; up]`` output split at a symbolic half, norms over a symbolic
width). Within bf16 rounding of
the eager functions (Inductor keeps fp32 between the ops it fuses, where eager rounds each to bf16); in fp32 the
reduction order only.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from actorcore.errors import PatchNotAppliedError
from actorcore.kernels.compiled_graphs import VARIANTS_LIMIT, GraphRunCounter, variant_room


def residual_add(out: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """``residual + (out + bias)``: Megatron's ``bias_dropout_add`` with dropout 0."""
    residual = residual if residual.dtype == out.dtype else residual.to(out.dtype)
    if bias is not None:
        out = out + bias
    return residual + out


def add_then_norm(out: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, norm: torch.nn.Module
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden, norm(hidden))`` with ``hidden = residual_add(out, bias, residual)``."""
    hidden = residual_add(out, bias, residual)
    return hidden, norm(hidden)


def apply_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


def qk_norms(query: torch.Tensor, key: torch.Tensor, q_norm: torch.nn.Module, k_norm: torch.nn.Module,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's q and k norms on views of the QKV projection: ``query`` ``[sq, b, ng, np/ng * hn]`` into its
    ``[sq, b, np, hn]`` heads, then each norm (``get_query_key_value_tensors`` without the query's copy)."""
    query = query.reshape(*query.shape[:2], -1, head_dim)
    return q_norm(query), k_norm(key)


def gated_activation(inter: torch.Tensor, bias: torch.Tensor | None, activation: Callable, gated: bool,
                     clamp: float | None, offset: float) -> torch.Tensor:
    """``MLP.forward``'s unfused activation: fc1's bias, then ``act(gate) * (up + offset)`` (gate clamped above, up
    both ways, at ``clamp``) for a gated unit, ``act(x)`` otherwise."""
    if bias is not None:
        inter = inter + bias
    if not gated:
        return activation(inter)
    x_glu, x_linear = torch.chunk(inter, 2, dim=-1)
    if clamp is not None:
        x_glu = x_glu.clamp(min=None, max=clamp)
        x_linear = x_linear.clamp(min=-clamp, max=clamp)
    if offset:  # Megatron adds its 0.0 default too: the same values (a zero's sign aside), one pass less
        x_linear = x_linear + offset
    return activation(x_glu) * x_linear


def expert_activation(inter_SO: torch.Tensor, bias_SO: torch.Tensor | None, probs_S: torch.Tensor,
                      activation: Callable, gated: bool, clamp: float | None, offset: float) -> torch.Tensor:
    """``gated_activation`` of expert rows times each row's routing probability (in the probability's dtype, fp32),
    rounded once to the rows' dtype: ``MLP.forward`` with ``per_token_scale``."""
    act = gated_activation(inter_SO, bias_SO, activation, gated, clamp, offset)
    return (act * probs_S.unsqueeze(-1)).to(act.dtype)


def rotary(q_TNH: torch.Tensor, k_TKH: torch.Tensor, cos_T1R: torch.Tensor, sin_T1R: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated as Megatron's ``_apply_rotary_pos_emb_bshd`` does (not interleaved): ``t * cos +
    rotate_half(t) * sin`` on the first ``R`` features, the rest passed through."""
    return _rotate(q_TNH, cos_T1R, sin_T1R), _rotate(k_TKH, cos_T1R, sin_T1R)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    width = cos.shape[-1]
    x, rest = t[..., :width], t[..., width:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


@functools.cache
def compiled(fn: Callable) -> Callable:
    """``fn`` compiled by Inductor with a symbolic token count and every other size static (one compilation per
    function, cached): the first dim of each tensor argument is marked dynamic (tokens or rows; a bias whose first dim
    is a width is then specialised by the shape it meets, without a recompilation). A call in which no compiled graph
    ran (Dynamo past its recompile limit runs ``fn`` uncompiled, with only a log line) raises; inside another compiled
    region the call is traced into that one's graph."""
    graphs = GraphRunCounter()
    inner = torch.compile(fn, backend=graphs)

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim():
                torch._dynamo.maybe_mark_dynamic(a, 0)
        if torch.compiler.is_compiling():
            return inner(*args)
        before = graphs.runs
        with variant_room():
            out = inner(*args)
        if graphs.runs == before:
            raise PatchNotAppliedError(
                f"the Megatron route's compiled {fn.__name__} ran no compiled graph: torch.compile ran it uncompiled "
                f"(past torch._dynamo.config.recompile_limit, here at least {VARIANTS_LIMIT} variants, or a frame "
                "Dynamo skipped; its log says which); refusing to continue unfused. Raise the limit, or build the "
                "model with compiled_layers=False")
        return out

    return run
