"""Loss-fused head: a token-wise loss of (log-prob, entropy) whose gradient is formed during the forward.

Shape suffixes: T tokens, C tokens of one chunk, D hidden, V vocab.

Why: ``linear_logprob_entropy`` returns per-token outputs, so their upstream gradients arrive only in
backward and the logits must be computed twice (8NHV of matmul work). RL losses are sums of per-token
terms (PPO/GRPO/DAPO clipped objectives, KL penalties, entropy bonus, any per-token weights and
normalisers), so each token's gradient w.r.t. its log-prob and entropy is known as soon as that
token's statistics are. The Triton path then computes each chunk's logits once (fp32 statistics, the
logits kept as fp16 z - max until the gradients are known) and forms grad_hidden and grad_weight from
them: 6NHV, the work of Liger's scalar-loss kernel, with entropy, temperature and fp32 statistics.
Layouts the Triton path cannot load with TMA, and other backends, evaluate the loss chunk by chunk the
same way, with their forward and backward per chunk (8NHV); ``backend="reference"`` is plain autograd
through the fp32 reference.

The loss must be token-wise: token t's loss may depend on logprob[t], entropy[t] and row t of each
``token_args`` tensor only. Sequence-level terms are token-wise once written with per-token weights
(e.g. ``seq-mean-token-mean``: weight 1 / (num_seqs * len(seq)) on each of the sequence's tokens).
Every call checks this on its first chunk (the loss of a chunk must equal the losses of its two halves)
and raises if it does not hold; losses that need all of a sequence's log-probs at once (GSPO's
sequence ratio) must use ``linear_logprob_entropy``.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

import torch

from actorcore.kernels.logprob._common import check_inputs, compute_dtype, finish_stats
from actorcore.kernels.logprob.api import BACKENDS, select_engine
from actorcore.kernels.logprob.chunked import default_chunk_rows
from actorcore.kernels.logprob.reference import linear_logprob_entropy_reference
from actorcore.kernels.precision import autocast_disabled
from actorcore.kernels.trace import add
from actorcore.outputs import LossOutput

TokenLoss = Callable[..., torch.Tensor]


def linear_logprob_loss(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    loss_fn: TokenLoss,
    *,
    token_args: Sequence[torch.Tensor] = (),
    temperature: float = 1.0,
    entropy: bool = True,
    backend: str = "auto",
    chunk_size: int | None = None,
    softcap: float | None = None,
    trace: Counter[str] | None = None,
    batch_invariant: bool = False,
) -> LossOutput:
    """``loss = sum_t loss_fn(logprob, entropy, *token_args)[t]`` with z = cap(hidden @ weight.T) / T.

    ``loss_fn(logprob_C, entropy_C, *args_C)`` gets float32 [C] tensors for a chunk of tokens (entropy
    None when ``entropy=False``) and the same rows of each ``token_args`` tensor, and returns the [C]
    per-token losses. ``token_args`` are constants: no gradient flows to them. Backend selection and
    numerics are those of ``linear_logprob_entropy``; ``trace`` counts what ran (keys in ``actorcore.kernels``).
    ``batch_invariant``: each token's log-prob and entropy do not depend on the other tokens of the call.
    """
    check_loss_fn(loss_fn)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends are {', '.join(BACKENDS)}")
    check_inputs(
        hidden_TD, weight_VD, labels_T, temperature=temperature, softcap=softcap, chunk_size=chunk_size,
        entropy=entropy, trace=trace, batch_invariant=batch_invariant,
    )
    token_args = check_token_args(token_args, labels_T.shape[0], labels_T.device)
    want_grads = torch.is_grad_enabled() and (hidden_TD.requires_grad or weight_VD.requires_grad)
    if backend == "reference" and not batch_invariant:
        add(trace, "logprob:reference")
        return _composed(hidden_TD, weight_VD, labels_T, loss_fn, token_args, temperature, entropy, softcap,
                         want_grads)
    engine = select_engine(backend, hidden_TD, batch_invariant)  # refuses reference + batch_invariant
    token_loss = _ChunkedTokenLoss(loss_fn, token_args, want_grads)
    loss, logprob_T, ent_T = _FusedLossFunction.apply(
        hidden_TD, weight_VD, labels_T, engine, token_loss, float(temperature),
        None if softcap is None else float(softcap), bool(entropy), chunk_size, trace,
    )
    return LossOutput(loss, logprob_T, ent_T)


def check_loss_fn(loss_fn: TokenLoss) -> None:
    """Refuse a ``loss_fn`` that cannot be called, before any work is done."""
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable (logprob, entropy, *token_args) -> per-token losses, got "
                         f"{type(loss_fn).__name__}")


def masked_token_loss(loss_fn: TokenLoss) -> TokenLoss:
    """``loss_fn`` taking a leading keep mask among its token args: the losses of the rows it does not keep are 0.

    A packed head runs at the predicting positions, some of which score nothing (every sequence's last token,
    padding); their rows of ``token_args`` are zeros, and their losses are dropped here rather than trusted to be 0
    (a loss may be nonzero at zero inputs, e.g. ``exp(logprob - old_logprob)``). A result that is not one loss per
    row passes through, so ``linear_logprob_loss`` says what was wrong."""

    def masked(logprob_C, entropy_C, keep_C, *args_C):
        loss_C = loss_fn(logprob_C, entropy_C, *args_C)
        if not isinstance(loss_C, torch.Tensor) or loss_C.shape != logprob_C.shape:
            return loss_C
        return torch.where(keep_C, loss_C, torch.zeros_like(loss_C))

    return masked


def check_token_args(
    token_args: Sequence[torch.Tensor], n_tok: int, device: torch.device | None
) -> tuple[torch.Tensor, ...]:
    """A tuple (or list) of constant tensors with one row per token (on ``device``, unless None)."""
    if not isinstance(token_args, (tuple, list)):
        what = "a bare tensor" if isinstance(token_args, torch.Tensor) else type(token_args).__name__
        raise ValueError(f"token_args must be a tuple of [tokens, ...] tensors, got {what}; for one tensor pass "
                         "a 1-tuple: token_args=(advantages,)")
    token_args = tuple(token_args)
    for i, arg in enumerate(token_args):
        if not isinstance(arg, torch.Tensor) or arg.dim() < 1 or arg.shape[0] != n_tok:
            raise ValueError(
                f"token_args[{i}] must be a tensor with one row per token ({n_tok}), got "
                f"{tuple(arg.shape) if isinstance(arg, torch.Tensor) else type(arg).__name__}"
            )
        if arg.requires_grad:
            raise ValueError(f"token_args[{i}] requires grad; token_args are constants: pass it detached")
        if device is not None and arg.device != device:
            raise ValueError(f"token_args[{i}] is on {arg.device}, the tokens are on {device}; move it there "
                             f"with .to({str(device)!r})")
    return token_args


def _per_token_losses(loss_fn: TokenLoss, logprob_C, entropy_C, args_C) -> torch.Tensor:
    """``loss_fn`` on one chunk; raises if it changed its inputs in place or did not return one loss per token."""
    named = [("the log-probs", logprob_C), ("the entropies", entropy_C)]
    named += [(f"token_args[{i}]", a) for i, a in enumerate(args_C)]
    named = [(name, t) for name, t in named if t is not None and not t.is_inference()]  # those track versions
    versions = [t._version for _, t in named]
    try:
        loss_C = loss_fn(logprob_C, entropy_C, *args_C)
    except TypeError as err:
        if entropy_C is None:
            raise ValueError(f"loss_fn failed on entropy=None ({err}): with entropy=False it gets None for the "
                             "entropies; pass entropy=True if the loss uses them") from err
        raise
    changed = [name for (name, t), v in zip(named, versions) if t._version != v]
    if changed:
        raise ValueError(
            f"loss_fn modifies its inputs in place ({', '.join(changed)}): the head reuses them, so the losses "
            "and gradients would be wrong. Use out-of-place ops (logprob * w, not logprob.mul_(w)), or clone an "
            "input before changing it"
        )
    if not isinstance(loss_C, torch.Tensor) or loss_C.shape != logprob_C.shape:
        got = tuple(loss_C.shape) if isinstance(loss_C, torch.Tensor) else type(loss_C).__name__
        raise ValueError(
            f"loss_fn must return one loss per token (shape {tuple(logprob_C.shape)}), got {got}; "
            "return per-token losses and let the head sum them"
        )
    return loss_C


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


@torch.no_grad()
def check_token_wise(loss_fn: TokenLoss, logprob_C, entropy_C, args_C) -> None:
    """Raise if ``loss_fn`` is not token-wise (a chunk's losses must equal those of its two halves), writes into
    its inputs or does not return one loss per token. Runs on copies: the caller's tensors stay untouched."""
    n = logprob_C.shape[0]
    half = n // 2

    def rows(lo, hi):  # copies: a loss_fn that writes into its inputs is refused without touching the caller's
        return (logprob_C[lo:hi].clone(), None if entropy_C is None else entropy_C[lo:hi].clone(),
                [a[lo:hi].clone() for a in args_C])

    whole = _per_token_losses(loss_fn, *rows(0, n)).float()
    if n < 2:
        return
    split = torch.cat([_per_token_losses(loss_fn, *rows(0, half)), _per_token_losses(loss_fn, *rows(half, n))])
    if not torch.allclose(whole, split.float(), rtol=1e-5, atol=1e-6, equal_nan=True):
        raise ValueError(
            "loss_fn is not token-wise: its per-token losses change when the tokens are split into chunks "
            "(e.g. a mean over the tokens it is given). Normalise with per-token weights passed in token_args, "
            "or use linear_logprob_entropy and compute the loss yourself"
        )


class _ChunkedTokenLoss:
    """Calls the user's loss on one chunk: sums its losses and returns d(loss)/d(logprob, entropy)."""

    def __init__(self, loss_fn: TokenLoss, token_args: tuple[torch.Tensor, ...], want_grads: bool):
        self.loss_fn = loss_fn
        self.token_args = token_args
        self.want_grads = want_grads
        self.total: torch.Tensor | None = None
        self.checked = False
        self.has_grad_path = False  # some chunk's loss depends on its log-probs / entropies with grad

    def __call__(self, start: int, end: int, logprob_C: torch.Tensor, entropy_C: torch.Tensor | None):
        args_C = [a[start:end] for a in self.token_args]
        if not self.checked:
            check_token_wise(self.loss_fn, logprob_C, entropy_C, args_C)
            self.checked = True
        inputs = [logprob_C.detach().requires_grad_(self.want_grads)]
        if entropy_C is not None:
            inputs.append(entropy_C.detach().requires_grad_(self.want_grads))
        with torch.enable_grad():
            loss_C = _per_token_losses(self.loss_fn, inputs[0], inputs[1] if len(inputs) > 1 else None, args_C)
            total_C = _at_least_fp32(loss_C).sum()
            grads = [None, None]
            if self.want_grads and total_C.requires_grad:
                grads = list(torch.autograd.grad(total_C, inputs, allow_unused=True)) + [None]
        self.has_grad_path |= grads[0] is not None or grads[1] is not None
        self.total = total_C.detach() if self.total is None else self.total + total_C.detach()
        return grads[0], grads[1]


class _FusedLossFunction(torch.autograd.Function):
    """Runs the engine's loss-fused forward; backward only scales the gradients it already formed."""

    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, labels_T, engine, token_loss, temperature, softcap, entropy, chunk_size,
                trace):
        need_h = token_loss.want_grads and ctx.needs_input_grad[0]
        need_w = token_loss.want_grads and ctx.needs_input_grad[1]
        run = getattr(engine, "fused_loss_forward", None)
        kw = dict(temperature=temperature, softcap=softcap, entropy=entropy, chunk_size=chunk_size,
                  need_hidden=need_h, need_weight=need_w, trace=trace)
        with autocast_disabled(hidden_TD.device):  # fp32 logits (and loss_fn) also inside a caller's autocast
            out = NotImplemented if run is None else run(hidden_TD, weight_VD, labels_T, token_loss, **kw)
            if out is NotImplemented:  # the engine has no fused path for these inputs
                out = _loss_forward_by_chunks(engine, hidden_TD, weight_VD, labels_T, token_loss, **kw)
        logprob_T, ent_T, grad_h, grad_w = out
        if token_loss.want_grads and token_loss.total is not None and not token_loss.has_grad_path:
            _raise_no_grad_path()
        ctx.grads = (grad_h, grad_w)
        ctx.mark_non_differentiable(logprob_T, *(() if ent_T is None else (ent_T,)))
        loss = token_loss.total if token_loss.total is not None else logprob_T.new_zeros(())
        return loss, logprob_T, ent_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_logprob, _grad_ent):
        if ctx.grads is None:
            raise RuntimeError(
                "linear_logprob_loss supports one backward per forward: its gradients are formed in the "
                "forward and scaled in place (retain_graph=True cannot replay them); call it again instead"
            )
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        no_grads = (None,) * 10
        if grad_loss is None:
            return no_grads
        if grad_h is not None:
            grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w.mul_(grad_loss.to(grad_w.dtype))
        return (grad_h, grad_w) + no_grads[2:]


def _loss_forward_by_chunks(
    engine, hidden_TD, weight_VD, labels_T, token_grads, *, temperature, softcap, entropy, chunk_size,
    need_hidden, need_weight, trace,
):
    """``fused_loss_forward`` for any engine: per chunk, its statistics, the loss's gradients, its backward.

    The logits are computed twice (8NHV); what it shares with the Triton path is the chunk-by-chunk
    evaluation of the loss, so every backend calls ``loss_fn`` the same way.
    """
    n_tok, vocab = hidden_TD.shape[0], weight_VD.shape[0]
    rows = chunk_size or default_chunk_rows(vocab)
    cdt = compute_dtype(hidden_TD.dtype)
    dev = hidden_TD.device
    logprob_T = torch.empty(n_tok, dtype=cdt, device=dev)
    ent_T = torch.empty(n_tok, dtype=cdt, device=dev) if entropy else None
    grad_h = torch.empty_like(hidden_TD) if need_hidden else None
    grad_w = torch.zeros(weight_VD.shape, dtype=cdt, device=dev) if need_weight else None
    kw = dict(temperature=temperature, softcap=softcap, chunk_size=None, trace=trace)
    for start in range(0, n_tok, rows):
        end = min(start + rows, n_tok)
        h_CD, labels_C = hidden_TD[start:end], labels_T[start:end]
        lse_C, logprob_C, ent_C = finish_stats(*engine.forward_stats(h_CD, weight_VD, labels_C, entropy=entropy, **kw))
        logprob_T[start:end] = logprob_C
        if ent_T is not None:
            ent_T[start:end] = ent_C
        glp_C, gent_C = token_grads(start, end, logprob_C, ent_C)
        if not (need_hidden or need_weight):
            continue
        if glp_C is None and gent_C is None:
            if grad_h is not None:
                grad_h[start:end].zero_()
            continue
        gh_CD, gw_VD = engine.backward(
            h_CD, weight_VD, labels_C, lse_C, ent_C, glp_C, gent_C, need_hidden=need_hidden,
            need_weight=need_weight, **kw,
        )
        if grad_h is not None:
            grad_h[start:end] = gh_CD
        if grad_w is not None:
            grad_w += gw_VD
    return logprob_T, ent_T, grad_h, None if grad_w is None else grad_w.to(weight_VD.dtype)


def _raise_no_grad_path() -> None:
    raise ValueError(
        "loss_fn's loss does not depend on the log-probs or entropies with gradient (it detaches them, uses "
        ".item() or torch.no_grad(), or computes from token_args only), so backward would train with zero "
        "gradients. Compute the per-token losses from the logprob / entropy tensors loss_fn is given; to only "
        "evaluate the loss, call under torch.no_grad()"
    )


def _composed(hidden_TD, weight_VD, labels_T, loss_fn, token_args, temperature, entropy, softcap, want_grads):
    """The reference: plain fp32-logit outputs with autograd, then the summed loss."""
    with autocast_disabled(hidden_TD.device):  # loss_fn runs outside autocast, as on the chunked path
        logprob_T, ent_T = linear_logprob_entropy_reference(
            hidden_TD, weight_VD, labels_T, temperature=temperature, entropy=entropy, softcap=softcap
        )
        check_token_wise(loss_fn, logprob_T.detach(), None if ent_T is None else ent_T.detach(), token_args)
        loss = _at_least_fp32(_per_token_losses(loss_fn, logprob_T, ent_T, token_args)).sum()
    if want_grads and logprob_T.numel() and (not loss.requires_grad or all(
            g is None for g in torch.autograd.grad(loss, [o for o in (logprob_T, ent_T) if o is not None],
                                                   retain_graph=True, allow_unused=True))):
        _raise_no_grad_path()
    return LossOutput(loss, logprob_T.detach(), None if ent_T is None else ent_T.detach())
