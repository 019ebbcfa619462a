"""Partial causal attention of some queries against one block of keys, with its log-sum-exp (ring attention).

Context parallelism with a ring exchange attends a rank's queries to one rank's keys at a time and merges
the partial softmaxes: ``merge_attention_blocks`` is the standard log-sum-exp merge, and
``attention_block_backward`` is the flash-style backward of one block given the *merged* output and
log-sum-exp (so no block's probabilities are kept between forward and backward).

Queries and keys are described per segment as runs of consecutive positions (``position_runs``): the query
at position ``p`` sees the key at position ``j`` of the same segment iff ``j <= p`` (and ``p - j < window``).
Pairs of runs with no visible key are skipped; fully visible pairs need no mask. All math is fp32.

Legend: ``L`` queries, ``M`` keys, ``N`` query heads, ``K`` key/value heads, ``H`` head dim (``V`` of values).
"""

from __future__ import annotations

import torch

# Per segment, its runs (start, stop, first position): rows [start, stop) hold positions first, first + 1, ...
Runs = list[list[tuple[int, int, int]]]


def position_runs(cu_seqlens: torch.Tensor, positions: torch.Tensor, max_run: int | None = None) -> Runs:
    """The runs of consecutive positions of every segment (host tensors: read once, cache the result).

    ``max_run`` cuts longer runs into tiles: a pair of tiles' scores ``[N, max_run, max_run]`` is the most any
    step holds at once, and tiles entirely in the future of a query tile are skipped."""
    if max_run is not None and max_run < 1:
        raise ValueError(f"max_run must be a positive number of tokens, got {max_run}")
    bounds, pos = cu_seqlens.tolist(), positions.tolist()
    if len(pos) != bounds[-1]:
        raise ValueError(f"{len(pos)} positions but the segments end at {bounds[-1]}")
    runs: Runs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        segment = []
        while start < end:
            stop = start + 1
            while stop < end and pos[stop] == pos[stop - 1] + 1 and (max_run is None or stop - start < max_run):
                stop += 1
            segment.append((start, stop, pos[start]))
            start = stop
        runs.append(segment)
    return runs


def _visible_pairs(q_runs: Runs, k_runs: Runs, window: int | None):
    """(q run, k run, needs a mask) for every pair of runs of a segment with at least one visible key."""
    if len(q_runs) != len(k_runs):
        raise ValueError(f"queries have {len(q_runs)} segments but keys {len(k_runs)}")
    for q_segment, k_segment in zip(q_runs, k_runs):
        for qa, qb, qp in q_segment:
            q_last = qp + qb - qa - 1
            for ka, kb, kp in k_segment:
                k_last = kp + kb - ka - 1
                if kp > q_last or (window and qp - k_last >= window):
                    continue  # every key in the future (or out of every query's window)
                masked = k_last > qp or bool(window and q_last - kp >= window)
                yield (qa, qb, qp), (ka, kb, kp), masked


def _scores(q_LNH, k_MKH, q_run, k_run, masked, scale, window):
    """Scaled scores ``[N, q, k]`` of a pair of runs (invisible ones at -inf), its queries and its keys
    ``[N, k, H]`` (``q_LNH`` and ``k_MKH`` already fp32)."""
    (qa, qb, qp), (ka, kb, kp) = q_run, k_run
    groups = q_LNH.shape[1] // k_MKH.shape[1]
    q_NQH = q_LNH[qa:qb].transpose(0, 1)
    k_NKH = k_MKH[ka:kb].transpose(0, 1).repeat_interleave(groups, dim=0)
    scores = torch.matmul(q_NQH, k_NKH.transpose(-1, -2)) * scale
    if masked:
        device = q_LNH.device
        diff = (qp + torch.arange(qb - qa, device=device))[:, None] - (kp + torch.arange(kb - ka, device=device))[None]
        allowed = diff >= 0
        if window:
            allowed &= diff < window
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores, q_NQH, k_NKH


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (rows that see no key) as 0, so ``exp(score - lse)`` is 0 there instead of NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_attention_blocks(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two disjoint key sets from each one's ``(out [..., H], lse [...])``.

    A row that saw no key has ``lse = -inf`` and ``out = 0`` and contributes nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _finite(lse)
    out = out_a * torch.exp(lse_a - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1)
    return out, lse


def attention_block_forward(q_LNH: torch.Tensor, k_MKH: torch.Tensor, v_MKV: torch.Tensor, q_runs: Runs,
                            k_runs: Runs, *, scale: float,
                            sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [L, N, V], lse [L, N])`` in fp32 of the queries against this block of keys (causal at their
    positions); rows that see none of the block's keys get ``out = 0`` and ``lse = -inf``."""
    L, N, _ = q_LNH.shape
    if N % k_MKH.shape[1]:
        raise ValueError(f"{N} query heads cannot share {k_MKH.shape[1]} key/value heads evenly")
    groups = N // k_MKH.shape[1]
    q_LNH, k_MKH, v_MKV = q_LNH.float(), k_MKH.float(), v_MKV.float()  # once, not per pair of tiles
    out = q_LNH.new_zeros(L, N, v_MKV.shape[-1], dtype=torch.float32)
    lse = q_LNH.new_full((L, N), float("-inf"), dtype=torch.float32)
    for q_run, k_run, masked in _visible_pairs(q_runs, k_runs, sliding_window):
        scores, _, _ = _scores(q_LNH, k_MKH, q_run, k_run, masked, scale, sliding_window)
        (qa, qb, _), (ka, kb, _) = q_run, k_run
        lse_NQ = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(lse_NQ).unsqueeze(-1))
        v_NKV = v_MKV[ka:kb].transpose(0, 1).repeat_interleave(groups, dim=0)
        pair_out, pair_lse = torch.matmul(probs, v_NKV).transpose(0, 1), lse_NQ.transpose(0, 1)
        out[qa:qb], lse[qa:qb] = merge_attention_blocks(out[qa:qb], lse[qa:qb], pair_out, pair_lse)
    return out, lse


def attention_block_backward(grad_LNV: torch.Tensor, q_LNH: torch.Tensor, k_MKH: torch.Tensor, v_MKV: torch.Tensor,
                             lse_LN: torch.Tensor, delta_LN: torch.Tensor, q_runs: Runs, k_runs: Runs, *,
                             scale: float, sliding_window: int | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``(dq [L, N, H], dk [M, K, H], dv [M, K, V])`` of this block's share of the attention.

    ``lse_LN`` is the log-sum-exp over *all* blocks and ``delta_LN = sum(grad * out)`` over the head dim of the
    merged output: with them each block's gradient is exact on its own (the flash-attention backward)."""
    L, N, _ = q_LNH.shape
    M, K, _ = k_MKH.shape
    groups = N // K
    grad, q_LNH, k_MKH, v_MKV = grad_LNV.float(), q_LNH.float(), k_MKH.float(), v_MKV.float()
    dq = torch.zeros(L, N, q_LNH.shape[-1], dtype=torch.float32, device=q_LNH.device)
    dk_MNH = torch.zeros(M, N, k_MKH.shape[-1], dtype=torch.float32, device=q_LNH.device)
    dv_MNV = torch.zeros(M, N, v_MKV.shape[-1], dtype=torch.float32, device=q_LNH.device)
    safe_lse = _finite(lse_LN)
    for q_run, k_run, masked in _visible_pairs(q_runs, k_runs, sliding_window):
        scores, q_NQH, k_NKH = _scores(q_LNH, k_MKH, q_run, k_run, masked, scale, sliding_window)
        (qa, qb, _), (ka, kb, _) = q_run, k_run
        probs = torch.exp(scores - safe_lse[qa:qb].transpose(0, 1).unsqueeze(-1))
        grad_NQV = grad[qa:qb].transpose(0, 1)
        v_NKV = v_MKV[ka:kb].transpose(0, 1).repeat_interleave(groups, dim=0)
        dv_MNV[ka:kb] += torch.matmul(probs.transpose(-1, -2), grad_NQV).transpose(0, 1)
        d_scores = probs * (torch.matmul(grad_NQV, v_NKV.transpose(-1, -2))
                            - delta_LN[qa:qb].transpose(0, 1).unsqueeze(-1)) * scale
        dq[qa:qb] += torch.matmul(d_scores, k_NKH).transpose(0, 1)
        dk_MNH[ka:kb] += torch.matmul(d_scores.transpose(-1, -2), q_NQH).transpose(0, 1)
    # Query heads that share a key/value head add up their gradients onto it.
    dk = dk_MNH.view(M, K, groups, -1).sum(2)
    dv = dv_MNV.view(M, K, groups, -1).sum(2)
    return dq, dk, dv
