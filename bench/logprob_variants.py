"""Kernel variants of the log-prob head at one shape: correctness against fp32, then time per variant.

    PYTHONPATH=src python bench/logprob_variants.py [--n 32768] [--d 4096] [--v 151936] [--json out.json]
        [--only loss,token,parts,liger]

Correctness first (fresh random inputs, N=2048 at the same H and V): log-prob / entropy against the fp32
reference and both gradients against fp32 autograd (relative to their largest magnitude), for every
variant. Then the median of CUDA-event timed forward+backward runs at N tokens; TFLOP/s at 6NHV.
Variants: the loss-fused path (``linear_logprob_loss``'s engine) at its chunk size and at twice it; the
per-token path with its backward blocked in other ways (tokens x vocabulary rows within the workspace, and
two rows with more workspace); the parts of the loss-fused chunk alone (cuBLAS rates for its gradient products); Liger's fused linear
cross-entropy with reduction="sum" and "none".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

GiB = 2**30
# A dry run of this script on the CPU: BENCH_DEVICE=cpu TRITON_INTERPRET=1 (fp16 there: the interpreter has no bf16)
DEV = os.environ.get("BENCH_DEVICE", "cuda")
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16


def _engines():
    """(loss-fused variants, per-token variants): label -> engine. The per-token variants sweep the backward's
    blocking (tokens x vocabulary rows per block within the workspace); two rows show what more memory would buy."""
    from actorcore.kernels.logprob.triton_blocking import FUSED_LOSS_WORKSPACE_BYTES
    from actorcore.kernels.logprob.triton_engine import TritonEngine

    loss = {
        "loss: default (2048-token chunks, 640 MiB)": TritonEngine(),
        "loss: 4096-token chunks (1280 MiB: more memory)": TritonEngine(
            loss_workspace_bytes=2 * FUSED_LOSS_WORKSPACE_BYTES),
    }
    token = {"token: default (vocab block 8192, 64 MiB)": TritonEngine()}
    for block in (2048, 4096, 16384, 32768):
        token[f"token: vocab block {block}, 64 MiB"] = TritonEngine(vocab_block=block)
    token["token: vocab block 8192, 128 MiB (more memory)"] = TritonEngine(workspace_bytes=128 << 20)
    token["token: one vocab block, 640 MiB (the loss path's memory)"] = TritonEngine(
        vocab_block=1 << 20, workspace_bytes=FUSED_LOSS_WORKSPACE_BYTES)
    return loss, token


def make_inputs(n, d, v, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(n, d, generator=g, device=DEV, dtype=DTYPE)
    w = (torch.randn(v, d, generator=g, device=DEV) * (3.0 / d**0.5)).to(DTYPE)
    y = torch.randint(0, v, (n,), generator=g, device=DEV)
    coef = torch.randn(n, generator=g, device=DEV), torch.randn(n, generator=g, device=DEV)
    return h, w, y, coef


def run_loss(engine, h, w, y, coef, temperature):
    from actorcore.kernels.logprob.fused_loss import _ChunkedTokenLoss, _FusedLossFunction

    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    tl = _ChunkedTokenLoss(lambda lp, ent, a, b: lp * a + ent * b, coef, True)
    loss, lp, ent = _FusedLossFunction.apply(hh, ww, y, engine, tl, temperature, None, True, None, None)
    loss.backward()
    return lp, ent, hh.grad, ww.grad


def run_token(engine, h, w, y, coef, temperature):
    from actorcore.kernels.logprob.function import LinearLogprobEntropyFunction

    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    lp, ent = LinearLogprobEntropyFunction.apply(hh, ww, y, engine, temperature, None, True, None, None, None)
    (lp * coef[0] + ent * coef[1]).sum().backward()
    return lp.detach(), ent.detach(), hh.grad, ww.grad


def run_liger(reduction):
    def run(engine, h, w, y, coef, temperature):
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = liger_fused_linear_cross_entropy(hh, ww, y, reduction=reduction)
        (loss if reduction == "sum" else loss * coef[0]).sum().backward()
        return None, None, hh.grad, ww.grad

    return run


def reference(h, w, y, coef, temperature):
    """fp32 autograd through the whole logits (N small enough to fit)."""
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    logp = torch.log_softmax((hh @ ww.t()) / temperature, -1)
    lp = logp.gather(1, y[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * coef[0] + ent * coef[1]).sum().backward()
    return lp.detach(), ent.detach(), hh.grad, ww.grad


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def check(fn, engine, d, v, ref_inputs, ref):
    lp, ent, gh, gw = fn(engine, *ref_inputs, 1.0)
    out = dict(grad_h_rel=rel(gh, ref[2]), grad_w_rel=rel(gw, ref[3]))
    if lp is not None:
        out.update(dlp=(lp - ref[0]).abs().max().item(), dent=(ent - ref[1]).abs().max().item())
    return out


def time_it(f, reps=5):
    if DEV != "cuda":  # the dry run: one timed call
        f()
        t = time.perf_counter()
        f()
        return (time.perf_counter() - t) * 1e3
    from logprob import median_ms  # bench/logprob.py, beside this script

    return median_ms(f, reps)


def peak_extra(f):
    if DEV != "cuda":
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = f()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    del out
    return extra / GiB


def parts(n, d, v, res):
    """The loss-fused chunk's stages alone, at 2048 tokens (cuBLAS rates for the gradient products)."""
    from dataclasses import replace

    from actorcore.kernels.logprob.triton_blocking import cdiv, padded_row
    from actorcore.kernels.logprob.triton_engine import TritonEngine

    eng = TritonEngine(loss=replace(TritonEngine().loss, num_stages=3))
    rows = min(n, 2048)
    h, w, y, coef = make_inputs(rows, d, v, seed=5)
    z = torch.empty(rows, padded_row(v), dtype=torch.float16, device=DEV)
    zv, gv = z[:, :v], z.view(DTYPE)[:, :v]
    shift = torch.empty(rows, cdiv(v, eng._shift_cols()), device=DEV)
    flop = 2 * rows * d * v
    stats = eng._stats_and_shifted_logits(h, w, y, zv, shift, 1.0, None, True)
    from actorcore.kernels.logprob._common import finish_stats

    lse, lp, ent = finish_stats(*stats)
    out = {}
    out["fused kernel (matmul + stats + fp16 store)"] = (time_it(
        lambda: eng._stats_and_shifted_logits(h, w, y, zv, shift, 1.0, None, True)), flop)
    for flat in (False, True):
        fe = TritonEngine(fwd=replace(eng.fwd, flatten=flat))
        out[f"forward stats kernel alone (no store), flatten={flat}"] = (time_it(
            lambda: fe.forward_stats(h, w, y, temperature=1.0, softcap=None, entropy=True, chunk_size=None)), flop)
    le = TritonEngine(loss=replace(eng.loss, num_stages=4))
    out["fused kernel, stages=4"] = (time_it(
        lambda: le._stats_and_shifted_logits(h, w, y, zv, shift, 1.0, None, True)), flop)
    out["fp16 -> grad in place (memory-bound)"] = (time_it(
        lambda: eng._shifted_to_grad(zv, gv, shift, y, lse, ent, coef[0], coef[1], 1.0, None, eng._shift_cols())), 0)
    gh = torch.empty(rows, d, dtype=DTYPE, device=DEV)
    out["grad_h = G @ W (cuBLAS)"] = (time_it(lambda: torch.mm(gv, w, out=gh)), flop)
    gw = torch.randn_like(w)
    out["grad_w += G^T h (cuBLAS addmm, K=2048)"] = (time_it(lambda: gw.addmm_(gv.t(), h)), flop)
    out["grad_w += G^T h[:1024] (cuBLAS addmm, K=1024)"] = (time_it(lambda: gw.addmm_(gv[:1024].t(), h[:1024])), flop / 2)
    if DEV == "cuda":
        out["cuBLAS fp32 logits [1024, V]"] = (time_it(lambda: torch.mm(h[:1024], w.t(), out_dtype=torch.float32)),
                                               flop / 2)
    for k, (ms, fl) in out.items():
        rate = f"{fl / ms / 1e9:7.1f} TFLOP/s" if fl else f"{rows * v * 4 / ms / 1e6:7.1f} GB/s"
        print(f"part  {k:55s} {ms:8.3f} ms {rate}", flush=True)
        res.append(dict(kind="part", label=k, ms=ms, flop=fl))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--only", default="loss,token,parts,liger")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    only = set(args.only.split(","))
    n, d, v = args.n, args.d, args.v
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"# {name}, torch {torch.__version__}, N={n} H={d} V={v}", flush=True)
    loss_engines, token_engines = _engines()
    variants = []
    if "loss" in only:
        variants += [(k, run_loss, e) for k, e in loss_engines.items()]
    if "token" in only:
        variants += [(k, run_token, e) for k, e in token_engines.items()]
    if "liger" in only:
        try:
            import liger_kernel.transformers.functional  # noqa: F401

            variants += [("liger reduction=sum (no entropy)", run_liger("sum"), None),
                         ("liger reduction=none, per-token grads (no entropy)", run_liger("none"), None)]
        except Exception as err:  # noqa: BLE001 - reported
            print(f"# liger not importable: {err}", flush=True)
    res = []
    ref_inputs = make_inputs(min(n, 2048), d, v, seed=11)
    ref = reference(*ref_inputs, 1.0)
    failed = set()
    for label, fn, eng in variants:
        try:
            c = check(fn, eng, d, v, ref_inputs, ref)
        except Exception as err:  # noqa: BLE001 - a variant Triton cannot compile here is a result
            failed.add(label)
            print(f"check {label:55s} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
            res.append(dict(kind="check", label=label, error=f"{type(err).__name__}: {str(err)[:300]}"))
            continue
        print(f"check {label:55s} " + " ".join(f"{k} {x:.2e}" for k, x in c.items()), flush=True)
        res.append(dict(kind="check", label=label, **c))
    del ref
    if "parts" in only:
        parts(n, d, v, res)
    inputs = make_inputs(n, d, v, seed=0)
    flop = 6 * n * d * v
    for label, fn, eng in [x for x in variants if x[0] not in failed]:
        ms = time_it(lambda: fn(eng, *inputs, 1.0), reps=3)
        extra = peak_extra(lambda: fn(eng, *inputs, 1.0))
        print(f"time  {label:55s} {ms:8.1f} ms {flop / ms / 1e9:6.0f} TF/s +{extra:.2f} GiB", flush=True)
        res.append(dict(kind="time", label=label, ms=ms, tflops=flop / ms / 1e9, extra_gib=extra))
        if args.json:
            json.dump(res, open(args.json, "w"), indent=1)
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
