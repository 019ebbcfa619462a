"""Ring attention's per-block kernel on the GPU: flash attention (forward with its log-sum-exp, and the flash
backward given the merged output and log-sum-exp), for blocks whose runs of positions line up.

``block_attention`` is the plain fp32 version that handles any layout. This one covers the load-balanced
context-parallel layout, where a query run and a key run of the same segment are either the same positions
(the diagonal: causal), or every key lies before every query (fully visible), or after (invisible). Per block,
the query runs that see some keys become segments of at most two varlen flash calls (causal ones and fully
visible ones), each query run's keys gathered in position order. ``plan_flash_block`` returns ``None`` for any
other layout (a sliding window, runs cut at other places): the caller then uses ``block_attention``.

Legend: ``L`` queries, ``M`` keys of the block, ``N`` query heads, ``K`` key/value heads, ``H`` head dim.
"""

from __future__ import annotations

import torch

from actorcore.kernels.attention.block_attention import Runs
from actorcore.kernels.attention.varlen import FLASH_DTYPES, VarlenCall

MAX_HEAD_DIM = 256


def plan_flash_block(q_runs: Runs, k_runs: Runs, num_queries: int) -> list[VarlenCall] | None:
    """The flash calls of one block (host tensors), or ``None`` if a pair of runs overlaps other than on the
    diagonal. ``num_queries`` is the number of query rows (to tell whether a call covers them all)."""
    if len(q_runs) != len(k_runs):
        raise ValueError(f"queries have {len(q_runs)} segments but keys {len(k_runs)}")
    groups: dict[bool, list[tuple[int, int, list[tuple[int, int]]]]] = {True: [], False: []}
    for q_segment, k_segment in zip(q_runs, k_runs):
        ordered = sorted(k_segment, key=lambda run: run[2])
        for qa, qb, qp in q_segment:
            q_last = qp + qb - qa - 1
            seen, causal = [], False
            for ka, kb, kp in ordered:
                if kp > q_last:
                    continue  # every key in the future
                if kp + kb - ka - 1 < qp:
                    seen.append((ka, kb))  # every key before every query
                elif kp == qp and kb - ka == qb - qa:
                    seen.append((ka, kb))  # the same positions: last in position order
                    causal = True
                else:
                    return None
            if seen:
                groups[causal].append((qa, qb, seen))
    return [_flash_call(causal, entries, num_queries) for causal, entries in groups.items() if entries]


def _flash_call(causal: bool, entries: list, num_queries: int) -> VarlenCall:
    q_rows, k_rows, cu_q, cu_k, max_q, max_k = [], [], [0], [0], 0, 0
    for qa, qb, seen in entries:
        q_rows.append(torch.arange(qa, qb))
        k_rows.extend(torch.arange(ka, kb) for ka, kb in seen)
        cu_q.append(cu_q[-1] + qb - qa)
        cu_k.append(cu_k[-1] + sum(kb - ka for ka, kb in seen))
        max_q, max_k = max(max_q, qb - qa), max(max_k, cu_k[-1] - cu_k[-2])
    q_index = torch.cat(q_rows)
    if q_index.numel() == num_queries and torch.equal(q_index, torch.arange(num_queries)):
        q_index = None
    return VarlenCall(causal, q_index, torch.cat(k_rows), torch.tensor(cu_q, dtype=torch.int32),
                     torch.tensor(cu_k, dtype=torch.int32), max_q, max_k)


def flash_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the flash kernels take these inputs (CUDA, 16-bit, equal head dims of at most 256)."""
    return (q.is_cuda and q.dtype in FLASH_DTYPES and q.shape[-1] == k.shape[-1] == v.shape[-1] <= MAX_HEAD_DIM
            and q.shape[1] % k.shape[1] == 0)


def _take(rows: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return rows if index is None else rows.index_select(0, index)


def _unused(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dropout RNG state the flash backward takes (no dropout here: never read)."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


def flash_block_forward(q_LNH: torch.Tensor, k_MKH: torch.Tensor, v_MKH: torch.Tensor, calls: list[VarlenCall], *,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [L, N, H], lse [L, N])`` in fp32, as ``block_attention.attention_block_forward`` returns them."""
    L, N, H = q_LNH.shape
    out = q_LNH.new_zeros(L, N, v_MKH.shape[-1], dtype=torch.float32)
    lse = q_LNH.new_full((L, N), float("-inf"), dtype=torch.float32)
    for call in calls:
        call_out, call_lse = torch.ops.aten._flash_attention_forward(
            _take(q_LNH, call.q_index), k_MKH.index_select(0, call.k_index), v_MKH.index_select(0, call.k_index),
            call.cu_q, call.cu_k, call.max_q, call.max_k, 0.0, call.causal, False, scale=scale)[:2]
        if call_lse.shape != (N, call_out.shape[0]):  # torch's varlen layout; older releases padded it per segment
            raise RuntimeError(f"this torch's flash attention returned a log-sum-exp of shape {tuple(call_lse.shape)}"
                               f", not (heads, tokens) = {(N, call_out.shape[0])}: use cp_comm_type='all_gather'")
        if call.q_index is None:
            out, lse = call_out.float(), call_lse.t().float()
        else:
            out.index_copy_(0, call.q_index, call_out.float())
            lse.index_copy_(0, call.q_index, call_lse.t().float())
    return out, lse


def flash_block_backward(grad_LNH: torch.Tensor, q_LNH: torch.Tensor, k_MKH: torch.Tensor, v_MKH: torch.Tensor,
                         out_LNH: torch.Tensor, lse_LN: torch.Tensor, calls: list[VarlenCall], *,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``(dq [L, N, H], dk [M, K, H], dv [M, K, H])`` of this block's share, from the *merged* output and
    log-sum-exp over all blocks (flash's backward then gives each block's exact share)."""
    dq = torch.zeros(q_LNH.shape, dtype=torch.float32, device=q_LNH.device)
    dk = torch.zeros(k_MKH.shape, dtype=torch.float32, device=k_MKH.device)
    dv = torch.zeros(v_MKH.shape, dtype=torch.float32, device=v_MKH.device)
    rng_state, unused = _unused(q_LNH.device)
    dtype = q_LNH.dtype
    for call in calls:
        call_dq, call_dk, call_dv = torch.ops.aten._flash_attention_backward(
            _take(grad_LNH, call.q_index).to(dtype).contiguous(), _take(q_LNH, call.q_index),
            k_MKH.index_select(0, call.k_index), v_MKH.index_select(0, call.k_index),
            _take(out_LNH, call.q_index).to(dtype).contiguous(), _take(lse_LN, call.q_index).t().contiguous(),
            call.cu_q, call.cu_k, call.max_q, call.max_k, 0.0, call.causal, rng_state, unused, scale=scale)
        if call.q_index is None:
            dq += call_dq.float()
        else:
            dq.index_add_(0, call.q_index, call_dq.float())
        dk.index_add_(0, call.k_index, call_dk.float())
        dv.index_add_(0, call.k_index, call_dv.float())
    return dq, dk, dv
