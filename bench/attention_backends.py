"""Packed causal attention on the GPU: torch's FlashAttention-2 (``varlen_attn``), FlashAttention-4 (flash-attn-4's
CuTe DSL kernels, through actorcore's ``fa4`` backend) and cuDNN's ragged SDPA (``aten._cudnn_attention_forward`` /
``_backward`` with cumulative sequence offsets), forward and forward+backward, on the actor step's packs (RL-shaped
lengths, the heads of the benchmarked models) and on long single sequences.

Why: attention is a quarter of the fused actor step's kernel time and most of a long sequence's; FA2 reaches well
under half of the H200's matmul rate. cuDNN ships inside torch's CUDA wheel and has Hopper kernels (torch's
``varlen_attn`` has a cuDNN branch that it leaves switched off, so this measures the aten ops directly); FA4 needs
flash-attn-4 with the CuTe DSL (``pip install 'actorcore[fa4]'``, or carried as wheels).

    PYTHONPATH=src:/tmp/site python3 bench/attention_backends.py [--pack 32768] [--backends flash2,fa4,...]
        [--heads qwen2.5-1.5b,...] [--long 131072,262144,524288] [--long-heads qwen3-8b] [--window W] [--reps 5]
        [--json out.json]

Per head shape and backend: max |Δ| of the output and of dq / dk / dv against an fp32 per-sequence reference (a
4K-token pack), whether the backward is bitwise repeatable, and the median of CUDA-event timed calls (TFLOP/s
counted on the visible half: forward 2 x 2 x pairs x heads x head_dim, pairs = L^2/2 per causal sequence, backward
2.5x that). ``--long``: one sequence of each length, FA2 against FA4, timed only (its exactness is the GPU test's:
tests/gpu/test_fa4_attention_cuda.py).
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

HEADS = {"qwen2.5-1.5b": (12, 2, 128), "qwen3-8b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}  # (q, kv, dim)


def heads_label(name: str) -> str:
    nq, nk, _ = HEADS[name]
    return f"{name} ({nq} q, {nk} kv)"


def rl_lengths(total: int, seed: int) -> list[int]:
    """Sequence lengths of 256-6144 tokens (the actor step's RL batch) filling a pack of ``total`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(256, 6145, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def make(lengths, nq, nk, hd, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)
    q, k, v, do = (torch.randn(t, n, hd, generator=g, device="cuda", dtype=dtype) for n in (nq, nk, nk, nq))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    return q, k, v, do, cu, max(lengths)


WINDOW: int | None = None  # --window: every backend's sliding window (None: the whole causal prefix)


def flash2(q, k, v, cu, max_len):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(WINDOW - 1 if WINDOW else -1, 0))


def fa4(q, k, v, cu, max_len):
    """FlashAttention-4 as actorcore runs it (``varlen_causal_attention(backend="fa4")``: its custom ops)."""
    from actorcore.kernels.attention.varlen import varlen_causal_attention

    return varlen_causal_attention(q, k, v, cu, max_len, sliding_window=WINDOW, backend="fa4")


class CudnnRagged(torch.autograd.Function):
    """cuDNN ragged causal SDPA on [T, heads, head_dim] with cumulative offsets (k / v expanded to the q heads)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=q.shape[-1] ** -0.5)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        empty = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            do.contiguous(), q, k, v, out, lse, seed, offset, empty, cu, cu, ctx.max_len, ctx.max_len, 0.0, True,
            scale=q.shape[-1] ** -0.5)
        return dq, dk, dv, None, None


def cudnn(q, k, v, cu, max_len, expand=True):
    if expand and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return CudnnRagged.apply(q, k, v, cu, max_len)


def cudnn_nested(q, k, v, cu, max_len):
    """The supported route into cuDNN's ragged kernels: SDPA on nested (jagged) tensors, cuDNN backend forced."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    offsets = cu.to(torch.int64)
    qn, kn, vn = (torch.nested.nested_tensor_from_jagged(x, offsets, max_seqlen=max_len).transpose(1, 2)
                  for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
    return out.transpose(1, 2).values()


def reference(q, k, v, cu):
    """fp32 causal attention per sequence (plain SDPA math, GQA expanded; the ``--window`` band as a mask)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        i = torch.arange(b - a, device=q.device)
        mask = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < WINDOW) if WINDOW else True)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
    return torch.cat(outs)


def grads(fn, q, k, v, do, cu, max_len):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, cu, max_len)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def accuracy(fn, nq, nk, hd):
    lengths = rl_lengths(4096, seed=3)
    q, k, v, do, cu, max_len = make(lengths, nq, nk, hd, seed=4)
    ref = grads(lambda q, k, v, cu, m: reference(q, k, v, cu), q, k, v, do.float(), cu, max_len)
    got = grads(fn, q, k, v, do, cu, max_len)
    again = grads(fn, q, k, v, do, cu, max_len)
    errs = {name: float((g.float() - r).abs().max()) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    errs["bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(got, again))
    return errs


def timed(fn, reps=10):
    from logprob import median_ms  # bench/logprob.py, beside this script

    return median_ms(fn, reps)


def visible_pairs(n: int) -> int:
    """(query, key) pairs a causal sequence of ``n`` tokens computes (within ``--window``)."""
    if not WINDOW or WINDOW >= n:
        return n * (n + 1) // 2
    return WINDOW * (WINDOW + 1) // 2 + (n - WINDOW) * WINDOW


def speed(fn, nq, nk, hd, lengths, reps=10):
    q, k, v, do, cu, max_len = make(lengths, nq, nk, hd, seed=2)
    flops_fwd = sum(2 * 2 * visible_pairs(n) * nq * hd for n in lengths)
    with torch.no_grad():
        fwd = timed(lambda: fn(q, k, v, cu, max_len), reps)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    both = timed(lambda: fn(qq, kk, vv, cu, max_len).backward(do), reps)
    return {"fwd_ms": fwd, "fwd_bwd_ms": both, "fwd_tflops": flops_fwd / fwd / 1e9,
            "fwd_bwd_tflops": 3.5 * flops_fwd / both / 1e9, "sequences": len(lengths), "tokens": sum(lengths)}


BACKENDS = {"flash2": flash2, "fa4": fa4, "cudnn_nested": cudnn_nested, "cudnn_expanded": cudnn,
            "cudnn_gqa": lambda q, k, v, cu, m: cudnn(q, k, v, cu, m, expand=False)}
NAMES = {"flash2": "flash2 (varlen_attn)", "fa4": "fa4 (flash-attn-4)", "cudnn_nested": "cudnn via nested SDPA, "
         "k/v expanded", "cudnn_expanded": "cudnn ragged, k/v expanded", "cudnn_gqa": "cudnn ragged, native GQA"}


def run_row(row: dict, measure) -> dict:
    try:
        row.update(measure())
    except Exception as exc:  # noqa: BLE001 - a backend that refuses a shape is a result
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        row["where"] = traceback.format_exc()[-1500:]
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    global WINDOW
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", type=int, default=32768)
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"of {sorted(BACKENDS)}")
    ap.add_argument("--heads", default=",".join(HEADS), help=f"head shapes of the RL packs, of {sorted(HEADS)} "
                    "('' for none)")
    ap.add_argument("--long", default="", help="single-sequence lengths, FA2 against FA4 (e.g. 131072,262144)")
    ap.add_argument("--long-heads", default="qwen2.5-1.5b", choices=sorted(HEADS))
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    WINDOW = args.window
    wanted = [b for b in args.backends.split(",") if b]
    if unknown := [b for b in wanted if b not in BACKENDS] + [h for h in args.heads.split(",") if h and h not in HEADS]:
        raise SystemExit(f"unknown backends / heads {unknown}; backends: {sorted(BACKENDS)}, heads: {sorted(HEADS)}")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}, "
          f"window {WINDOW}")
    rows = []
    for shape in [h for h in args.heads.split(",") if h]:
        nq, nk, hd = HEADS[shape]
        for key in wanted:
            fn = BACKENDS[key]
            rows.append(run_row({"heads": heads_label(shape), "backend": NAMES[key]}, lambda: {
                **accuracy(fn, nq, nk, hd), **speed(fn, nq, nk, hd, rl_lengths(args.pack, seed=1), args.reps)}))
    nq, nk, hd = HEADS[args.long_heads]
    for length in [int(n) for n in args.long.split(",") if n]:
        for key in [k for k in ("flash2", "fa4") if k in wanted]:
            fn = BACKENDS[key]
            rows.append(run_row({"heads": heads_label(args.long_heads), "backend": NAMES[key], "long": length},
                                lambda: speed(fn, nq, nk, hd, [length], max(1, min(args.reps, 3)))))
    print(f"{'heads':<28} {'backend':<22} {'tokens':>8} {'fwd ms':>9} {'fwd+bwd ms':>11} {'fwd TF/s':>9} "
          f"{'f+b TF/s':>9} {'max|dq|':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['heads']:<28} {r['backend']:<22} error: {r['error'][:80]}")
        else:
            print(f"{r['heads']:<28} {r['backend'][:22]:<22} {r['tokens']:>8} {r['fwd_ms']:9.2f} "
                  f"{r['fwd_bwd_ms']:11.2f} {r['fwd_tflops']:9.0f} {r['fwd_bwd_tflops']:9.0f} "
                  f"{r.get('dq', float('nan')):9.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
