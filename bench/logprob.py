"""Benchmark of per-token log-prob (+ entropy) heads on one GPU: time, TFLOP/s, extra memory, accuracy.

Shape suffixes: T tokens (N in the tables), D hidden (H), V vocab.

    PYTHONPATH=src python bench/logprob.py [--quick] [--sweep] [--head-sweep] [--json out.json] [--md out.md]

``--head-sweep``: forward+backward at T=1.0 of the Triton paths against Liger's three heads over the
RL shapes (8K-64K tokens, H=3584-4096, V=152K-262K).

Implementations, side by side, all bf16 inputs:
  naive   bf16 matmul -> [N, V] logits (rounded to bf16), fp32 log_softmax + entropy
  torch   actorcore chunked torch backend (fp32 logits per chunk, recompute in backward)
  triton  actorcore Triton backend (default configuration, what backend="auto" runs): per-token outputs,
          per-token upstream gradients, logits recomputed in backward (8NHV)
  triton_loss  actorcore linear_logprob_loss on the Triton backend: the same sum of log-probs and
          entropies as a token-wise loss, gradient formed in the forward (6NHV); forward-only cells run
          its no-grad path (the forward statistics kernel, then the loss chunk by chunk)
  quack_stats_loss  the same head on ``quack_stats.QuackStatsEngine``: the statistics from quack's warp-specialised
          GEMM epilogue (``bench/quack_stats.py``) and grad_weight accumulated by quack's GEMM (Hopper, quack)
  liger   Liger-Kernel fused linear cross-entropy, reduction="sum" for fwd+bwd: the gradient is computed
          in the forward, which only a scalar loss allows (no entropy; temperature folded into hidden)
  liger_tok  the same with reduction="none": per-token losses and upstream grads, recompute in backward
  liger_rl  Liger's RL-shaped head (LigerFusedLinearScaledCrossEntropyFunction: per-token NLL and entropy,
          temperature; CuTe DSL kernels on SM90): n/a where its CuTe runtime does not import
  cce     cut-cross-entropy linear_cross_entropy (no entropy; temperature folded into hidden)
  quack_lce  quack-kernels' chunked linear cross-entropy (CuTe DSL, SM90: bf16 exp(z - k) stored by the logits
          GEMM's epilogue, the gradient GEMMs scale it in their operand load, fp32 weight gradient), reduction="sum"
          for fwd+bwd (no entropy; temperature folded into hidden); forward-only cells: bf16 logits, per token

Time: median of CUDA-event timed runs after a warm-up. TFLOP/s counts 2NHV (forward) or 6NHV
(forward+backward: the matmul work without recompute). Extra peak memory: max allocated during one
run minus allocated before it, gradients included. Accuracy: max |delta| per token against an fp32
reference computed in chunks (tf32 off) from the same bf16 inputs. Cells that run out of memory print OOM.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys

import torch

GiB = 2**30

SHAPES = [
    (8192, 4096, 151936),
    (32768, 4096, 151936),
    (65536, 4096, 151936),
    (16384, 3584, 152064),
    (16384, 4096, 262144),
]
HEAD_SWEEP_SHAPES = [
    (8192, 4096, 151936),
    (32768, 4096, 151936),
    (65536, 4096, 151936),
    (16384, 3584, 152064),
    (32768, 3584, 152064),
    (16384, 4096, 262144),
    (32768, 4096, 262144),
]
HEAD_SWEEP_IMPLS = ("triton", "triton_loss", "quack_stats_loss", "liger", "liger_tok", "liger_rl", "quack_lce")
TEMPERATURES = (1.0, 0.7)
IMPLS = ("naive", "torch", "triton", "triton_loss", "quack_stats_loss", "liger", "liger_tok", "liger_rl", "cce", "quack_lce")
NO_ENTROPY = {"liger", "liger_tok", "cce", "quack_lce"}


# ----------------------------------------------------------------------------- implementations


def _naive(h, w, y, temperature, loss_reduction):
    logits = (h @ w.t()).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(1, y[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _ours(backend, **kw):
    from actorcore.kernels.logprob import linear_logprob_entropy

    def run(h, w, y, temperature, loss_reduction):
        return linear_logprob_entropy(h, w, y, temperature=temperature, backend=backend, **kw)

    return run


def _ours_loss(backend):
    """Our loss-fused head on the same objective as the other cells: sum of log-probs plus entropies."""
    from actorcore.kernels.logprob import linear_logprob_loss

    def run(h, w, y, temperature, loss_reduction):
        out = linear_logprob_loss(h, w, y, lambda lp, ent: lp + ent, temperature=temperature, backend=backend)
        return (out.loss, None) if loss_reduction == "sum" else (out.logprob, out.entropy)

    return run


def _ours_quack_stats_loss(h, w, y, temperature, loss_reduction):
    """The loss-fused head with its statistics from quack's GEMM epilogue (a benchmark variant: ``quack_stats``)."""
    from quack_stats import QuackStatsEngine

    from actorcore.kernels.logprob.fused_loss import _ChunkedTokenLoss, _FusedLossFunction

    token_loss = _ChunkedTokenLoss(lambda lp, ent: lp + ent, (), True)
    loss, lp, ent = _FusedLossFunction.apply(h, w, y, QuackStatsEngine(), token_loss, temperature, None,
                                             True, None, None)
    return (loss, None) if loss_reduction == "sum" else (lp, ent)


def _ours_engine(engine, chunk_size=None):
    from actorcore.kernels.logprob.function import LinearLogprobEntropyFunction

    def run(h, w, y, temperature, loss_reduction):
        return LinearLogprobEntropyFunction.apply(h, w, y, engine, temperature, None, True, chunk_size, None, None)

    return run


def _liger(h, w, y, temperature, loss_reduction):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    hs = h if temperature == 1.0 else h * (1.0 / temperature)
    loss = liger_fused_linear_cross_entropy(hs, w, y, reduction=loss_reduction)
    return -loss, None


def _liger_per_token(h, w, y, temperature, loss_reduction):
    """Liger with reduction="none": per-token losses and per-token upstream grads (what RL needs);
    Liger then recomputes the logits in backward, like we do."""
    return _liger(h, w, y, temperature, "none")


def _liger_rl(h, w, y, temperature, loss_reduction):
    """Liger's RL head: per-token NLL and entropy with per-token upstream gradients, temperature inside."""
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    nll, ent = LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, y, temperature, -100, 1, True)
    return -nll, ent


def _cce(h, w, y, temperature, loss_reduction):
    from cut_cross_entropy import linear_cross_entropy

    hs = h if temperature == 1.0 else h * (1.0 / temperature)
    loss = linear_cross_entropy(hs, w, y, reduction=loss_reduction)
    return -loss, None


def _quack_lce(h, w, y, temperature, loss_reduction):
    """quack's linear cross-entropy: its scaled-exp pipeline for a summed loss (auto-selected on SM90, bf16)."""
    from quack.linear_cross_entropy import chunked_linear_cross_entropy, linear_cross_entropy_func

    hs = h if temperature == 1.0 else h * (1.0 / temperature)
    if loss_reduction == "sum":
        # quack's default chunk of 4096 rows, 8192 where the hidden size is 4096: quack 0.6.4 cannot tell its dx
        # GEMM's per-row operand from a per-column one when the chunk's rows equal the hidden size (ValueError)
        chunk = 8192 if h.shape[1] == 4096 else 4096
        return -chunked_linear_cross_entropy(hs, w, y, chunk_size=chunk, reduction="sum"), None
    return -linear_cross_entropy_func(hs, w, None, y, reduction="none"), None


def get_impl(name):
    return {
        "naive": _naive,
        "torch": _ours("torch"),
        "triton": _ours("triton"),
        "triton_loss": _ours_loss("triton"),
        "quack_stats_loss": _ours_quack_stats_loss,
        "liger": _liger,
        "liger_tok": _liger_per_token,
        "liger_rl": _liger_rl,
        "cce": _cce,
        "quack_lce": _quack_lce,
    }[name]


def available(name) -> str | None:
    try:
        if name in ("liger", "liger_tok"):
            import liger_kernel.transformers.functional  # noqa: F401
        elif name == "liger_rl":
            from liger_kernel.ops import fused_linear_scaled_cross_entropy as rl

            rl._resolve_implementation(torch.device("cuda"))  # SM90: imports its CuTe DSL kernels
        elif name == "cce":
            import cut_cross_entropy  # noqa: F401
        elif name == "quack_lce":
            import quack.linear_cross_entropy  # noqa: F401
        elif name in ("triton", "triton_loss", "quack_stats_loss"):
            import triton  # noqa: F401
    except Exception as err:  # noqa: BLE001 - reported in the table
        return f"not importable: {type(err).__name__}: {err}"
    return None


# ----------------------------------------------------------------------------- measurement


def make_inputs(n, d, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, d, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(v, d, generator=g, device="cuda") * (3.0 / d**0.5)).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=g, device="cuda")
    return h, w, y


@torch.no_grad()
def reference(h, w, y, temperature, rows=4096):
    """fp32 per-token logprob and entropy, chunked over tokens so it fits."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        w32 = w.float()
        lp = torch.empty(h.shape[0], device="cuda")
        ent = torch.empty(h.shape[0], device="cuda")
        for s in range(0, h.shape[0], rows):
            z = (h[s : s + rows].float() @ w32.t()) / temperature
            logp = torch.log_softmax(z, -1)
            lp[s : s + rows] = logp.gather(1, y[s : s + rows, None]).squeeze(1)
            ent[s : s + rows] = -(logp.exp() * logp).sum(-1)
            del z, logp
        return lp, ent
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _cleanup():
    gc.collect()
    torch.cuda.empty_cache()


def run_once(fn, h, w, y, temperature, backward):
    if backward:
        hh = h.detach().requires_grad_()
        ww = w.detach().requires_grad_()
        lp, ent = fn(hh, ww, y, temperature, "sum")
        loss = lp.sum() if lp.dim() else lp
        if ent is not None:
            loss = loss + ent.sum()
        loss.backward()
        return hh.grad, ww.grad
    with torch.no_grad():
        return fn(h, w, y, temperature, "none")


def time_cell(fn, h, w, y, temperature, backward, budget_s=2.0, max_reps=10):
    """(median ms, extra peak bytes) of one configuration; raises torch.cuda.OutOfMemoryError."""
    out = run_once(fn, h, w, y, temperature, backward)  # warm-up / compile
    del out
    torch.cuda.synchronize()
    _cleanup()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = run_once(fn, h, w, y, temperature, backward)
    end.record()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    del out
    first_ms = start.elapsed_time(end)
    reps = int(max(2, min(max_reps, budget_s * 1000 / max(first_ms, 1e-3))))
    times = [first_ms]
    for _ in range(reps):
        start.record()
        out = run_once(fn, h, w, y, temperature, backward)
        end.record()
        torch.cuda.synchronize()
        del out
        times.append(start.elapsed_time(end))
    return statistics.median(times), extra


def accuracy(fn, h, w, y, temperature, ref):
    lp, ent = run_once(fn, h, w, y, temperature, backward=False)
    d_lp = (lp.float() - ref[0]).abs().max().item()
    d_ent = None if ent is None else (ent.float() - ref[1]).abs().max().item()
    return d_lp, d_ent


# ----------------------------------------------------------------------------- sweep


def median_ms(f, reps=5):
    """Median CUDA-event time of ``f()`` over ``reps`` runs, after one warm-up run."""
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def sweep(n=16384, d=4096, v=151936):
    """Time the Triton kernels' blockings and chunks against the cuBLAS matmul floor."""
    from actorcore.kernels.logprob.triton_engine import TritonEngine

    h, w, y = make_inputs(n, d, v)
    flop = 2 * n * d * v
    res = []

    def bench(label, f, flops=flop):
        try:
            ms = median_ms(f)
            line = f"{label:70s} {ms:8.2f} ms {flops / ms / 1e9:7.1f} TFLOP/s"
        except Exception as err:  # noqa: BLE001 - a config that fails to compile is reported
            line = f"{label:70s} FAILED {type(err).__name__}: {str(err)[:200]}"
            ms = None
        print(line, flush=True)
        res.append({"label": label, "ms": ms})
        _cleanup()

    bench("cublas mm bf16->bf16 [N,D]x[D,V]", lambda: torch.mm(h, w.t()))
    bench("cublas mm bf16->fp32 [N,D]x[D,V] (out_dtype)", lambda: torch.mm(h, w.t(), out_dtype=torch.float32))
    rows = 4096
    g = torch.randn(rows, v, device="cuda").to(torch.bfloat16)
    bench(f"cublas mm G[{rows},V]xW (grad_hidden chunk)", lambda: torch.mm(g, w), 2 * rows * d * v)
    gw = torch.empty_like(w)
    bench(f"cublas addmm W += G^T h[{rows}] (grad_weight chunk)", lambda: gw.addmm_(g.t(), h[:rows]), 2 * rows * d * v)
    del g, gw
    _cleanup()

    kw = dict(temperature=0.7, softcap=None, entropy=True, chunk_size=None)
    eng = TritonEngine()  # TMA loads (aligned inputs); the pointer-load variant measured slower (docs/benchmarks.md)
    bench(f"fwd fused {eng.fwd}", lambda: eng.forward_stats(h, w, y, **kw))

    lse = torch.randn(n, device="cuda") + 12
    ent = torch.rand(n, device="cuda") * 5
    glp, gent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    bkw = dict(temperature=0.7, softcap=None, chunk_size=None)
    acc = torch.zeros(4096, d, device="cuda")
    g = torch.randn(4096, 2048, device="cuda").to(torch.bfloat16)
    bench("cublas addmm fp32 acc += G[4096,2048] x W[2048,D] (out_dtype)",
          lambda: torch.addmm(acc, g, w[:2048], out_dtype=torch.float32, out=acc), 2 * 4096 * 2048 * d)
    del acc, g
    bwd_runs = [  # (label, engine kwargs): the backward's blocking (tokens from the workspace budget)
        ("default: vocab block 8192, 64 MiB (2048 tokens)", {}),
        ("vocab block 2048, 80 MiB (4096 tokens)", dict(vocab_block=2048, workspace_bytes=80 << 20)),
        ("vocab block 4096, 96 MiB (4096 tokens)", dict(vocab_block=4096, workspace_bytes=96 << 20)),
        ("whole vocabulary, 512 MiB (1664 tokens)", dict(vocab_block=1 << 30, workspace_bytes=512 << 20)),
    ]
    for label, kw in bwd_runs:
        eng = TritonEngine(**kw)
        bench(f"bwd (grad_hidden + grad_weight) {label}", lambda: eng.backward(
            h, w, y, lse, ent, glp, gent, need_hidden=True, need_weight=True, **bkw), 3 * flop)

    def token_grads(start, end, lp, en):
        return glp[start:end], gent[start:end]

    eng = TritonEngine()
    for rows in (512, 1024, 2048):  # chunk tokens of the loss-fused forward (fused kernel, fp16 chunk buffer)
        bench(f"loss-fused forward (6NHV), chunk {rows}", lambda: eng.fused_loss_forward(
            h, w, y, token_grads, temperature=0.7, softcap=None, entropy=True, chunk_size=rows,
            need_hidden=True, need_weight=True), 3 * flop)
    return res


# ----------------------------------------------------------------------------- markdown


def _shape_label(n, d, v):
    return f"N={n} H={d} V={v}"


def to_markdown(cells, fits):
    """Tables for docs/benchmarks.md, generated from the measured cells (no hand-copied numbers)."""
    shapes = list(dict.fromkeys((c["N"], c["H"], c["V"]) for c in cells))
    impls = list(dict.fromkeys(c["impl"] for c in cells))
    temps = list(dict.fromkeys(c["T"] for c in cells))
    index = {(c["N"], c["H"], c["V"], c["T"], c["mode"], c["impl"]): c for c in cells}
    out = []
    for mode in [m for m in ("fwd+bwd", "fwd") if any(c["mode"] == m for c in cells)]:
        for t in temps:
            what = "forward + backward" if mode == "fwd+bwd" else "forward only"
            out.append(f"**{what}, temperature {t}** (median time, TFLOP/s at {6 if mode == 'fwd+bwd' else 2}NHV, "
                       "extra peak memory)\n")
            out.append("| implementation | " + " | ".join(_shape_label(*s) for s in shapes) + " |")
            out.append("|---|" + "---|" * len(shapes))
            for impl in impls:
                row = []
                for s in shapes:
                    c = index.get((*s, t, mode, impl))
                    row.append("" if c is None else fmt_cell(c).replace(" TF/s", " TF/s"))
                name = impl + (" (no entropy)" if impl in NO_ENTROPY else "")
                out.append(f"| {name} | " + " | ".join(row) + " |")
            out.append("")
    if any(c["mode"] == "fwd" for c in cells):  # accuracy comes from the forward-only cells
        out.append("**Accuracy**: max |Δ log-prob| / max |Δ entropy| over all tokens vs the fp32 reference "
                   "(forward outputs)\n")
        cols = [(s, t) for s in shapes for t in temps]
        out.append("| implementation | " + " | ".join(f"{_shape_label(*s)} T={t}" for s, t in cols) + " |")
        out.append("|---|" + "---|" * len(cols))
        for impl in impls:
            row = []
            for s, t in cols:
                c = index.get((*s, t, "fwd", impl))
                if c is None or "max_dlp" not in c:
                    row.append(c.get("status", "") if c else "")
                else:
                    ent = "n/a" if c["max_dent"] is None else f"{c['max_dent']:.1e}"
                    row.append(f"{c['max_dlp']:.1e} / {ent}")
            out.append(f"| {impl} | " + " | ".join(row) + " |")
        out.append("")
    if fits:
        out.append("**Largest N that fits** (H=4096, V=151936, bf16; N tried: 131072, 262144)\n")
        out.append("| implementation | forward only | forward + backward |")
        out.append("|---|---|---|")
        for impl in dict.fromkeys(f["impl"] for f in fits):
            got = {f["mode"]: f["largest_n"] for f in fits if f["impl"] == impl}
            out.append(f"| {impl} | {got.get('fwd')} | {got.get('fwd+bwd')} |")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- main


def fmt_cell(c):
    if c.get("status"):
        return c["status"]
    return f"{c['ms']:.1f} ms, {c['tflops']:.0f} TF/s, +{c['extra_gib']:.2f} GiB"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="first shape only, temperature 1.0")
    ap.add_argument("--sweep", action="store_true", help="time Triton kernel configurations, then exit")
    ap.add_argument("--impls", default=None, help=f"comma-separated (default: {','.join(IMPLS)})")
    ap.add_argument("--shapes", default=None, help="N:H:V,... (default: the five shapes of SHAPES)")
    ap.add_argument("--temps", default=None, help="comma-separated temperatures (default 1.0,0.7)")
    ap.add_argument("--head-sweep", action="store_true",
                    help="fwd+bwd, T=1.0, Triton paths vs Liger's heads over the RL shapes (HEAD_SWEEP_SHAPES)")
    ap.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    ap.add_argument("--fit", action="store_true", help="probe the largest N that fits for torch/triton/liger")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="write markdown tables of the results here")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, python {sys.version.split()[0]}", flush=True)
    if args.sweep:
        res = sweep()
        if args.json:
            json.dump({"sweep": res}, open(args.json, "w"), indent=1)
        return
    shapes, impls = (HEAD_SWEEP_SHAPES, HEAD_SWEEP_IMPLS) if args.head_sweep else (SHAPES, IMPLS)
    if args.shapes:  # --shapes and --impls narrow the head sweep too
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    impls = args.impls.split(",") if args.impls else list(impls)
    temps = tuple(float(t) for t in args.temps.split(",")) if args.temps else TEMPERATURES
    if args.quick:
        shapes, temps = shapes[:1], (1.0,)
    modes = tuple(args.modes.split(","))
    if args.head_sweep:
        temps, modes = (1.0,), ("fwd+bwd",)
    missing = {name: available(name) for name in impls}
    for name, why in missing.items():
        if why:
            print(f"# {name}: {why}", flush=True)
    cells = []
    for n, d, v in shapes:
        h, w, y = make_inputs(n, d, v)
        for temperature in temps:
            ref = reference(h, w, y, temperature) if "fwd" in modes else None  # accuracy: forward cells
            _cleanup()
            for mode in modes:
                for name in impls:
                    cell = dict(N=n, H=d, V=v, T=temperature, mode=mode, impl=name)
                    if missing[name]:
                        cell["status"] = "n/a"
                        cells.append(cell)
                        continue
                    fn = get_impl(name)
                    try:
                        budget = (1.5, 7) if temperature == temps[0] else (0.5, 3)  # fewer repeats for T=0.7
                        ms, extra = time_cell(fn, h, w, y, temperature, backward=mode == "fwd+bwd",
                                              budget_s=budget[0], max_reps=budget[1])
                        flop = (2 if mode == "fwd" else 6) * n * d * v
                        cell.update(ms=ms, tflops=flop / ms / 1e9, extra_gib=extra / GiB)
                        if mode == "fwd":
                            d_lp, d_ent = accuracy(fn, h, w, y, temperature, ref)
                            cell.update(max_dlp=d_lp, max_dent=d_ent)
                    except torch.cuda.OutOfMemoryError:
                        cell["status"] = "OOM"
                    except Exception as err:  # noqa: BLE001 - one failing tool must not stop the table
                        cell["status"] = f"error: {type(err).__name__}: {str(err)[:160]}"
                    _cleanup()
                    cells.append(cell)
                    if args.json:  # after every cell, so a run cut short keeps what it measured
                        json.dump({"cells": cells, "fits": []}, open(args.json, "w"), indent=1)
                    acc = ""
                    if "max_dlp" in cell:
                        acc = f" |dlp| {cell['max_dlp']:.2e}" + (
                            f" |dent| {cell['max_dent']:.2e}" if cell["max_dent"] is not None else " (no entropy)")
                    print(f"N={n} H={d} V={v} T={temperature} {mode:7s} {name:7s} {fmt_cell(cell)}{acc}", flush=True)
            del ref
        del h, w, y
        _cleanup()
    fits = []
    if args.fit:
        d, v = 4096, 151936
        for name in [i for i in ("triton", "triton_loss", "torch", "liger") if i in impls and not missing[i]]:
            for mode in ("fwd", "fwd+bwd"):
                best = None
                for n in (131072, 262144):
                    try:
                        h, w, y = make_inputs(n, d, v)
                        run_once(get_impl(name), h, w, y, 1.0, backward=mode == "fwd+bwd")
                        torch.cuda.synchronize()
                        best = n
                    except torch.cuda.OutOfMemoryError:
                        break
                    finally:
                        h = w = y = None
                        _cleanup()
                fits.append(dict(impl=name, mode=mode, largest_n=best))
                print(f"fit {name:7s} {mode:7s} largest N tried that fits: {best}", flush=True)
    if args.json:
        json.dump({"cells": cells, "fits": fits}, open(args.json, "w"), indent=1)
    md = to_markdown(cells, fits)
    print(md, flush=True)
    if args.md:
        open(args.md, "w").write(md + "\n")


if __name__ == "__main__":
    main()
