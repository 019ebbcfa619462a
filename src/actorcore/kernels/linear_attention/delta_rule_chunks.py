"""The chunked gated delta rule in torch: the step-major chunk layout, the per-chunk terms, and a lean training path.

Legend as in ``kernels.linear_attention.packed``; ``P`` padded slots (every sequence padded to whole chunks), ``c`` chunks,
``L`` the chunk size (64), ``n`` the sequences still running at a recurrence step.

``delta_rule_whole_pack`` is the first torch path: autograd through the whole pack at once, which keeps some twenty
fp32 pack-sized tensors for the backward (``bench/delta_rule.py`` and the tests compare against it).
``delta_rule_blocks`` (the torch backend's path) computes the same with the same operations on the same values but
holds far less. Its forward runs without autograd and saves only its inputs (token layout, as given) and the state
at the start of each block of consecutive steps (contiguous chunks of the step-major layout, about ``block_tokens``
slots). Its backward walks the blocks in reverse: it recomputes one block's per-chunk terms with autograd (batched
over the block's chunks, no Python loop), reruns the block's steps for the state before each, reverses the
recurrence by hand over them, and back-propagates the terms' gradients to the block's inputs in one
``autograd.grad``. So one block's terms, states and graph are alive at a time, and the Python step loop runs twice
forward and once in reverse per call (the removed head-group checkpointing re-ran the whole step loop once per
group, which is why it was slow).

The recurrence of step ``i`` (state ``S`` ``[n * M, K, V]``) and its reverse, given ``dS'`` and ``do``:
    u = new_v - kd @ S;   o = qg @ S + intra @ u;   S' = S * cd + kt @ u
    du = intra^T @ do + kt^T @ dS';  d_intra = do @ u^T;  d_qg = do @ S^T;  d_kt = dS' @ u^T;
    d_cd = sum(dS' * S);  d_new_v = du;  d_kd = -du @ S^T;  dS = dS' * cd + qg^T @ do - kd^T @ du
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64
BLOCK_TOKENS = 8192


def positions_in_sequence(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T]``: each token's offset from the start of its own sequence."""
    idx = torch.arange(num_tokens, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), idx, right=True)
    return idx - cu_seqlens.long()[seq]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (so gradients can be checked numerically)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def step_major_layout(cu_seqlens: torch.Tensor, num_tokens: int, chunk_size: int):
    """Where each token goes when every sequence is padded to whole chunks and the chunks are ordered by step.

    Step ``i`` holds the ``i``-th chunk of every sequence that has one, longest sequences first, so the sequences
    still running at step ``i`` are a prefix and each step's chunks are contiguous. Returns ``(dest_T,
    running_per_step)``: the padded slot of each token and how many sequences run at each step.
    """
    lengths_B = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    chunks_B = (lengths_B + chunk_size - 1) // chunk_size
    order = torch.argsort(chunks_B, descending=True, stable=True)
    rank_B = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    chunks_sorted = chunks_B[order].tolist()
    running = [sum(1 for c in chunks_sorted if c > i) for i in range(chunks_sorted[0] if chunks_sorted else 0)]
    step_offset = torch.tensor([0, *running], device=cu_seqlens.device).cumsum(0)
    seq_T = torch.searchsorted(cu_seqlens[1:].long(), torch.arange(num_tokens, device=cu_seqlens.device), right=True)
    pos_T = positions_in_sequence(cu_seqlens, num_tokens)
    dest_T = (step_offset[pos_T // chunk_size] + rank_B[seq_T]) * chunk_size + pos_T % chunk_size
    return dest_T, running


def chunk_terms(q, k, v, g, beta):
    """The per-chunk terms of the recurrence from chunked fp32 inputs (``[M, c, L, ...]``; q normalised and scaled,
    k normalised): ``(new_v, kd, qg, intra, kt, cd)`` (WY form; ``kt`` is ``[M, c, K, L]``, ``cd`` ``[M, c, 1, 1]``)."""
    chunk_size = q.shape[-2]
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    g = g.cumsum(-1)  # log decay from the chunk start to each position
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular after adding I (WY form)
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    q = q * g.exp()[..., None]
    k_t = (k * (g[..., -1:] - g).exp()[..., None]).transpose(-1, -2)
    chunk_decay = g[..., -1].exp()[..., None, None]
    return new_v, k_decayed, q, intra, k_t, chunk_decay


def delta_rule_whole_pack(q_TNK, k_TNK, v_TMV, g_TM, beta_TM, cu_seqlens, use_qk_l2norm, scale, chunk_size=CHUNK_SIZE):
    """Every sequence of the pack at once, in fp32: ``[T, M, V]``.

    Each sequence is padded to whole chunks (zero keys, values, decay and write strength: the padding changes
    nothing), the intra-chunk WY solves run batched over every chunk of the pack, and the state recurrence steps
    over the chunk index with all sequences that still have a chunk, so one Python step serves the whole pack
    and no state crosses a boundary: each sequence's state starts at zero in its own first chunk. The chunks are
    laid out step by step and split once, so autograd never builds a pack-sized gradient per step.
    """
    T, N, K = q_TNK.shape
    M, V = v_TMV.shape[1:]
    rep = M // N
    q, k = (x.repeat_interleave(rep, dim=1) if rep > 1 else x for x in (q_TNK, k_TNK))
    q, k, v, beta, g = (x.to(compute_dtype(q_TNK)) for x in (q, k, v_TMV, beta_TM, g_TM))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (K**-0.5 if scale is None else scale)
    dest_T, running = step_major_layout(cu_seqlens, T, chunk_size)
    if not running:
        return v_TMV.new_zeros(T, M, V, dtype=compute_dtype(q_TNK))
    total_chunks = sum(running)
    P = total_chunks * chunk_size

    def to_chunks(x):  # [T, M, ...] -> [M, chunks, chunk_size, ...], zero in the padding
        padded = x.new_zeros((P,) + x.shape[1:]).index_copy(0, dest_T, x)
        return padded.reshape(total_chunks, chunk_size, *x.shape[1:]).movedim(2, 0)

    q, k, v, beta, g = (to_chunks(x) for x in (q, k, v, beta, g))
    new_v, k_decayed, q, intra, k_t, chunk_decay = chunk_terms(q, k, v, g, beta)
    steps = zip(*(x.split(running, dim=1) for x in (new_v, k_decayed, q, intra, k_t, chunk_decay)))
    state = q.new_zeros(M, running[0], K, V)
    outs = []
    for n, (new_v_i, k_decayed_i, q_i, intra_i, k_t_i, chunk_decay_i) in zip(running, steps):
        state = state[:, :n]  # the sequences still running are a prefix
        v_i = new_v_i - k_decayed_i @ state
        outs.append(q_i @ state + intra_i @ v_i)
        state = state * chunk_decay_i + k_t_i @ v_i
    return torch.cat(outs, dim=1).reshape(M, P, V).index_select(1, dest_T).transpose(0, 1)


class _Block:
    """Consecutive recurrence steps ``steps`` over chunks ``[c0, c1)``; ``sizes``: the chunks (running sequences)
    of each step; ``slots``: which of its ``(c1 - c0) * L`` padded slots hold a token, ``tokens``: which token.

    A block's tensors are chunk-major, ``[c, H, L, ...]``, so each step's chunks are one contiguous slice and its
    batched matmuls need no copies."""

    def __init__(self, steps: range, sizes: list[int], c0: int, c1: int, slots: torch.Tensor, tokens: torch.Tensor):
        self.steps, self.sizes, self.c0, self.c1, self.slots, self.tokens = steps, sizes, c0, c1, slots, tokens

    def gather(self, x_T: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
        """``[T, H, ...]`` -> this block's ``[c, H, L, ...]`` in ``dtype`` (contiguous), zero in the padding."""
        slots = x_T.new_zeros(((self.c1 - self.c0) * chunk_size,) + x_T.shape[1:], dtype=dtype)
        slots.index_copy_(0, self.slots, x_T.index_select(0, self.tokens).to(dtype))
        return slots.reshape(self.c1 - self.c0, chunk_size, *x_T.shape[1:]).transpose(1, 2).contiguous()

    def scatter(self, x: torch.Tensor, into_T: torch.Tensor) -> None:
        """This block's ``[c, H, L, ...]`` into its tokens' rows of ``into_T`` (cast to its dtype)."""
        flat = x.transpose(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])
        into_T.index_copy_(0, self.tokens, flat.index_select(0, self.slots).to(into_T.dtype))


def _plan(cu_seqlens: torch.Tensor, num_tokens: int, chunk_size: int, block_tokens: int):
    """``(running, blocks)``: the sequences running at each step, and the steps grouped greedily into blocks of at
    most ``block_tokens`` slots (at least one step each)."""
    dest_T, running = step_major_layout(cu_seqlens, num_tokens, chunk_size)
    step_offset = [0]
    for n in running:
        step_offset.append(step_offset[-1] + n)
    src_P = torch.full((step_offset[-1] * chunk_size,), -1, dtype=torch.long, device=cu_seqlens.device)
    src_P[dest_T] = torch.arange(num_tokens, device=cu_seqlens.device)
    budget = max(1, block_tokens // chunk_size)
    spans, start = [], 0  # (first step, end step) of each block
    for i in range(1, len(running) + 1):
        if i == len(running) or step_offset[i + 1] - step_offset[start] > budget:
            spans.append((start, i))
            start = i
    filled_P = (src_P >= 0).nonzero()[:, 0]  # one device sync for all blocks, one more for their token counts
    ends = torch.tensor([step_offset[end] * chunk_size for _, end in spans], device=src_P.device)
    cuts = [0, *torch.searchsorted(filled_P, ends).tolist()]
    blocks = []
    for (first, end), a, b in zip(spans, cuts, cuts[1:]):
        c0 = step_offset[first]
        blocks.append(_Block(range(first, end), running[first:end], c0, step_offset[end],
                             filled_P[a:b] - c0 * chunk_size, src_P[filled_P[a:b]]))
    return running, blocks


def _block_terms(block, inputs, rep, scale, use_qk_l2norm, chunk_size):
    """The block's chunked inputs (leaves in the compute dtype) and its per-chunk terms (under the caller's grad
    mode)."""
    leaves = [block.gather(x, chunk_size, compute_dtype(inputs[0])) for x in inputs]
    if torch.is_grad_enabled():
        leaves = [x.requires_grad_() for x in leaves]
    q, k, v, g, beta = leaves
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return leaves, [t.flatten(0, 1) for t in chunk_terms(q, k, v, g, beta)]  # [c * M, ...]: 3-D batched matmuls


def _steps_forward(terms, state, block, states_before=None):
    """Run the block's steps from ``state`` (``[n * M, K, V]``, sequence-major); returns ``(outputs [c * M, L, V],
    state after)``; appends the state before each step to ``states_before`` when given. ``terms``: ``[c * M, ...]``."""
    M = terms[0].shape[0] // (block.c1 - block.c0)
    rows = [n * M for n in block.sizes]
    outs = []
    for n, new_v, kd, qg, intra, kt, cd in zip(rows, *(t.split(rows) for t in terms)):
        state = state[:n]  # the sequences still running are a prefix
        if states_before is not None:
            states_before.append(state)
        u = torch.baddbmm(new_v, kd, state, alpha=-1)
        outs.append(torch.baddbmm(qg @ state, intra, u))
        state = torch.baddbmm(state * cd, kt, u)
    return torch.cat(outs), state


def _steps_backward(terms, states_before, d_out, d_state, block):
    """The reverse of ``_steps_forward`` over the block: gradients of the six terms, and of the block's start state."""
    M = terms[0].shape[0] // (block.c1 - block.c0)
    rows = [n * M for n in block.sizes]
    grads = [torch.empty_like(t) for t in terms]
    per_step = zip(rows, states_before, d_out.split(rows), *(t.split(rows) for t in terms),
                   *(t.split(rows) for t in grads))
    for n, state, do, new_v, kd, qg, intra, kt, cd, d_new_v, d_kd, d_qg, d_intra, d_kt, d_cd in reversed(
            list(per_step)):
        if d_state.shape[0] < n:  # sequences whose last chunk was this step: their later state is unused
            d_state = torch.cat([d_state, d_state.new_zeros(n - d_state.shape[0], *d_state.shape[1:])])
        u = torch.baddbmm(new_v, kd, state, alpha=-1)
        du = torch.bmm(intra.transpose(-1, -2), do, out=d_new_v).baddbmm_(kt.transpose(-1, -2), d_state)
        torch.bmm(du, state.transpose(-1, -2), out=d_kd)  # negated once per block, below
        torch.bmm(do, state.transpose(-1, -2), out=d_qg)
        torch.bmm(do, u.transpose(-1, -2), out=d_intra)
        torch.bmm(d_state, u.transpose(-1, -2), out=d_kt)
        torch.bmm(d_state.flatten(1)[:, None], state.flatten(1)[:, :, None], out=d_cd)  # sum(dS' * S)
        d_state = torch.baddbmm(torch.baddbmm(d_state * cd, qg.transpose(-1, -2), do), kd.transpose(-1, -2), du,
                                alpha=-1)
    grads[1].neg_()
    return grads, d_state


class _DeltaRuleBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_TNK, k_TNK, v_TMV, g_TM, beta_TM, plan, rep, scale, use_qk_l2norm, chunk_size, out_dtype):
        running, blocks = plan
        T, M, V = v_TMV.shape
        K = q_TNK.shape[-1]
        inputs = (q_TNK, k_TNK, v_TMV, g_TM, beta_TM)
        out = v_TMV.new_zeros(T, M, V, dtype=out_dtype)
        state = v_TMV.new_zeros(running[0] * M, K, V, dtype=compute_dtype(q_TNK))
        starts = []
        for block in blocks:
            starts.append(state)
            _, terms = _block_terms(block, inputs, rep, scale, use_qk_l2norm, chunk_size)
            o, state = _steps_forward(terms, state, block)
            del terms
            block.scatter(o.unflatten(0, (-1, M)), out)
            del o
        ctx.save_for_backward(*inputs, *starts)
        ctx.plan, ctx.args = plan, (rep, scale, use_qk_l2norm, chunk_size)
        return out

    @staticmethod
    def backward(ctx, d_out_TMV):
        q_TNK, k_TNK, v_TMV, g_TM, beta_TM, *starts = ctx.saved_tensors
        _, blocks = ctx.plan
        rep, scale, use_qk_l2norm, chunk_size = ctx.args
        inputs = (q_TNK, k_TNK, v_TMV, g_TM, beta_TM)
        d_inputs = [torch.zeros_like(x) for x in inputs]
        d_state = None
        for block, start in zip(reversed(blocks), reversed(starts)):
            with torch.enable_grad():
                leaves, terms = _block_terms(block, inputs, rep, scale, use_qk_l2norm, chunk_size)
            states_before = []
            with torch.no_grad():
                plain = [t.detach() for t in terms]
                _steps_forward(plain, start, block, states_before)
                if d_state is None:
                    d_state = torch.zeros_like(states_before[-1])
                d_out = block.gather(d_out_TMV, chunk_size, compute_dtype(q_TNK)).flatten(0, 1)
                d_terms, d_state = _steps_backward(plain, states_before, d_out, d_state, block)
            del plain, states_before, d_out
            grads = torch.autograd.grad(terms, leaves, d_terms)
            del terms, d_terms, leaves
            for grad, into in zip(grads, d_inputs):
                block.scatter(grad, into)
            del grads
        return (*(d if need else None for d, need in zip(d_inputs, ctx.needs_input_grad)),
                None, None, None, None, None, None)


def delta_rule_blocks(q_TNK, k_TNK, v_TMV, g_TM, beta_TM, cu_seqlens, use_qk_l2norm, scale, chunk_size=CHUNK_SIZE,
                      block_tokens=BLOCK_TOKENS, out_dtype=None):
    """The gated delta rule over the pack, computed in fp32 (fp64 for fp64 inputs) with the lean backward of the
    module docstring; ``[T, M, V]`` in ``out_dtype`` (default: the compute dtype). ``block_tokens``: padded slots per
    block (more: fewer, larger batched ops; fewer: less memory)."""
    T, M, V = v_TMV.shape
    out_dtype = out_dtype or compute_dtype(q_TNK)
    plan = _plan(cu_seqlens, T, chunk_size, block_tokens)
    if not plan[0]:
        return v_TMV.new_zeros(T, M, V, dtype=out_dtype)
    return _DeltaRuleBlocks.apply(q_TNK, k_TNK, v_TMV, g_TM, beta_TM, plan, M // q_TNK.shape[1], scale,
                                  use_qk_l2norm, chunk_size, out_dtype)
