"""Where the time of the log-prob head goes: per-kernel GPU time of one forward+backward.

    PYTHONPATH=src python bench/profile_logprob.py [--n 32768] [--paths triton,triton_loss] [--md out.md]

Runs each path once to warm up (compile, cuBLAS handles), then once under ``torch.profiler`` and sums
the CUDA time of every kernel, grouped into stages by kernel name. ``--ncu`` instead runs each path once
without warm-up, for Nsight Compute to read the hardware counters of the Triton kernels, e.g.

    ncu --clock-control none -k regex:'fwd_stats|bwd_grad_logits|shifted_to_grad' -c 4 --section SpeedOfLight \\
        --section ComputeWorkloadAnalysis --section Occupancy python bench/profile_logprob.py --ncu --n 8192
"""

from __future__ import annotations

import argparse
import collections

import torch

STAGES = (  # (stage, substrings of kernel names), first match wins
    ("loss-fused: matmul + statistics + fp16 store (Triton)", ("fwd_stats_store_kernel",)),
    ("loss-fused: fp16 -> grad_logits in place (Triton)", ("shifted_to_grad_kernel",)),
    ("forward: fused matmul + online statistics (Triton)", ("fwd_stats_kernel",)),
    ("backward: recompute logits + grad_logits (Triton)", ("bwd_grad_logits",)),
    ("matmuls (cuBLAS)", ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas")),
)


def _stage(name: str) -> str:
    for stage, keys in STAGES:
        if any(k in name for k in keys):
            return stage
    return "other (elementwise, reductions, copies)"


def make_path(path: str, h, w, y):
    from actorcore.kernels.logprob import linear_logprob_entropy, linear_logprob_loss

    def run():
        hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
        if path == "triton_loss":
            loss = linear_logprob_loss(hh, ww, y, lambda lp, ent: lp + ent, backend="triton").loss
        else:
            lp, ent = linear_logprob_entropy(hh, ww, y, backend="triton")
            loss = lp.sum() + ent.sum()
        loss.backward()
        return hh.grad, ww.grad

    return run


def head_inputs(n: int, d: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded bf16 hidden states [n, d], weight [v, d] (logits of RL-like spread) and labels [n] on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, d, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(v, d, generator=g, device="cuda") * (3.0 / d**0.5)).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=g, device="cuda")
    return h, w, y


def profile(path: str, n: int, d: int, v: int) -> tuple[float, dict[str, tuple[float, int]], list]:
    run = make_path(path, *head_inputs(n, d, v))
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
    wall_ms = start.elapsed_time(end)
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time > 0:
            kernels[evt.name][0] += evt.device_time / 1000.0
            kernels[evt.name][1] += 1
    stages = collections.defaultdict(lambda: [0.0, 0])
    for name, (ms, calls) in kernels.items():
        stages[_stage(name)][0] += ms
        stages[_stage(name)][1] += calls
    top = sorted(((ms, calls, name) for name, (ms, calls) in kernels.items()), reverse=True)[:8]
    return wall_ms, {k: tuple(vv) for k, vv in stages.items()}, top


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--paths", default="triton,triton_loss")
    ap.add_argument("--ncu", action="store_true", help="run each path once, no warm-up, no profiler")
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.ncu:
        inputs = head_inputs(args.n, args.h, args.v)
        for path in args.paths.split(","):
            make_path(path, *inputs)()
        torch.cuda.synchronize()
        return
    flop = 2 * args.n * args.h * args.v
    lines = []
    for path in args.paths.split(","):
        wall_ms, stages, top = profile(path, args.n, args.h, args.v)
        kernel_ms = sum(ms for ms, _ in stages.values())
        lines.append(f"**{path}**, N={args.n} H={args.h} V={args.v}: {wall_ms:.1f} ms on the device clock, "
                     f"{kernel_ms:.1f} ms inside kernels ({wall_ms - kernel_ms:.1f} ms between them)\n")
        lines.append("| stage | kernel time | launches | share |")
        lines.append("|---|---|---|---|")
        for stage, (ms, calls) in sorted(stages.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"| {stage} | {ms:.1f} ms | {calls} | {100 * ms / wall_ms:.0f}% |")
        lines.append("")
        lines.append("| kernel (top 8 by time) | time | launches |")
        lines.append("|---|---|---|")
        for ms, calls, name in top:
            lines.append(f"| `{name[:90]}` | {ms:.1f} ms | {calls} |")
        lines.append(f"\n(2NHV = {flop / 1e12:.1f} TFLOP, {flop / 790e12 * 1e3:.1f} ms at 790 TFLOP/s)\n")
    md = "\n".join(lines)
    print(md, flush=True)
    if args.md:
        open(args.md, "w").write(md + "\n")


if __name__ == "__main__":
    main()
