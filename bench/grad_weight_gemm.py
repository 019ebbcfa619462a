"""The head's weight-gradient GEMM at its real shape: cuBLAS against a persistent Triton kernel.

The loss-fused head accumulates grad_weight[V, D] += G[C, V]^T @ h[C, D] once per 2048-token chunk (K = 2048,
bf16 output, 16 passes over grad_weight at 32K tokens); the per-token backward does the same per 8192-row block.
At K = 2048 cuBLAS's addmm ran at 670 TFLOP/s against 761 for grad_hidden's K = 151936. This measures whether
the C read and write, or the short K, is what costs, and whether a persistent TMA kernel that overlaps the next
tile's loads with this tile's epilogue (``tl.range(..., flatten=True)``) does better.

    PYTHONPATH=src python3 bench/grad_weight_gemm.py [--v 151936] [--d 4096] [--k 2048] [--calls 16]

Each row: ``--calls`` back-to-back calls (the head's loop), median of 5 CUDA-event timed rounds after a warm-up;
TFLOP/s at 2 * V * D * K per call; max error against an fp32 product, relative to its largest magnitude.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from actorcore.kernels.logprob.triton_kernels import _tile_ids  # the head's grouped tile order


@triton.jit
def grad_weight_kernel(g_desc, h_desc, c_desc, M, N, K, num_programs, ACCUMULATE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                       FLATTEN: tl.constexpr, SUBTILE: tl.constexpr, C_EARLY: tl.constexpr):
    """c[M, N] (+)= g[K, M]^T @ h[K, N], persistent over [BLOCK_M, BLOCK_N] tiles in grouped order.

    ``C_EARLY``: 0 loads c in the epilogue; 1 issues its load before the tile's K loop (its latency hidden under
    the matmul, 64 more registers per thread held through it); 2 starts the accumulator from c (no add after)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tile_out = tl.program_id(0) - num_programs
    for tile in tl.range(tl.program_id(0), num_m * num_n, num_programs, flatten=FLATTEN):
        pid_m, pid_n = _tile_ids(tile, num_m, num_n, GROUP)
        if C_EARLY == 2:
            acc = c_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N]).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if C_EARLY == 1:
            c_old = c_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N])
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(g_desc.load([k, pid_m * BLOCK_M]).T, h_desc.load([k, pid_n * BLOCK_N]), acc)
        tile_out += num_programs
        pid_m, pid_n = _tile_ids(tile_out, num_m, num_n, GROUP)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if C_EARLY == 1:
            acc += c_old.to(tl.float32)
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
        elif C_EARLY == 2:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
        elif SUBTILE:
            halves = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            for j in tl.static_range(2):
                part = halves[j]
                if ACCUMULATE:
                    part += c_desc.load([off_m, off_n + j * (BLOCK_N // 2)]).to(tl.float32)
                c_desc.store([off_m, off_n + j * (BLOCK_N // 2)], part.to(c_desc.dtype))
        else:
            if ACCUMULATE:
                acc += c_desc.load([off_m, off_n]).to(tl.float32)
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def _desc(t, block):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def triton_grad_weight(g_KM, h_KN, c_MN, accumulate, *, bm=128, bn=256, bk=64, stages=3, warps=8, group=8,
                       flatten=True, subtile=False, c_early=0):
    (k, m), n = g_KM.shape, h_KN.shape[1]
    programs = torch.cuda.get_device_properties(g_KM.device).multi_processor_count
    c_block = [bm, bn // 2] if subtile and not c_early else [bm, bn]
    grad_weight_kernel[(programs,)](
        _desc(g_KM, [bk, bm]), _desc(h_KN, [bk, bn]), _desc(c_MN, c_block), m, n, k, programs,
        ACCUMULATE=accumulate, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=group, FLATTEN=flatten, SUBTILE=subtile,
        C_EARLY=c_early,
        num_warps=warps, num_stages=stages,
    )


@contextlib.contextmanager
def blas(library):
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def timed(fn, calls):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = (torch.randn(args.k, args.v, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
    h = torch.randn(args.k, args.d, generator=gen, device="cuda").to(torch.bfloat16)
    c0 = (torch.randn(args.v, args.d, generator=gen, device="cuda") * 1e-2).to(torch.bfloat16)
    ref = c0.float() + g.float().t() @ h.float()
    scale = ref.abs().max().item()
    flop = 2 * args.v * args.d * args.k
    rows = []

    def row(name, fn, accumulate=True):
        c = c0.clone()
        fn(c)
        torch.cuda.synchronize()
        err = ((c.float() - (ref if accumulate else ref - c0.float())).abs().max().item()) / scale
        ms = timed(lambda: fn(c), args.calls)
        rows.append((name, ms, args.calls * flop / ms / 1e9, err))
        print(f"{name}: {ms:.2f} ms for {args.calls} calls, {rows[-1][2]:.0f} TFLOP/s, rel err {err:.1e}", flush=True)

    row("cuBLAS addmm_ (beta=1)", lambda c: c.addmm_(g.t(), h))
    row("cuBLAS mm out= (beta=0)", lambda c: torch.mm(g.t(), h, out=c), accumulate=False)
    with blas("cublaslt"):
        row("cuBLASLt addmm_ (beta=1)", lambda c: c.addmm_(g.t(), h))
        row("cuBLASLt mm out= (beta=0)", lambda c: torch.mm(g.t(), h, out=c), accumulate=False)
    variants = [
        dict(), dict(subtile=True), dict(flatten=False), dict(stages=4), dict(stages=4, subtile=True),
        dict(bm=256, bn=128, subtile=True), dict(group=16), dict(bk=128, stages=2),
        dict(c_early=1), dict(c_early=2), dict(c_early=1, flatten=False), dict(c_early=2, flatten=False),
        dict(c_early=1, stages=4),
    ]
    for kw in variants:
        name = "Triton persistent " + (", ".join(f"{k}={v}" for k, v in kw.items()) or "default (128x256x64, 3 stages, flatten)")
        try:
            row(name, lambda c, kw=kw: triton_grad_weight(g, h, c, True, **kw))
        except Exception as err:  # a config that does not compile: report it, go on
            print(f"{name}: failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
    lines = [f"V={args.v} D={args.d} K={args.k}, {args.calls} calls per round", "",
             "| kernel | time | TFLOP/s | max error / max |", "|---|---|---|---|"]
    lines += [f"| {n} | {ms:.2f} ms | {tf:.0f} | {e:.1e} |" for n, ms, tf, e in rows]
    md = "\n".join(lines)
    print(md, flush=True)
    if args.md:
        with open(args.md, "a") as f:
            f.write(md + "\n\n")


if __name__ == "__main__":
    main()
