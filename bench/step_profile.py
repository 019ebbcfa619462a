"""Shared pieces of the actor-step benchmarks: the RL batch split into packs, the timed step, MFU, and the
kernel-time breakdown by category from torch.profiler.

Categories (by kernel name): ``matmul`` (cuBLAS / CUTLASS / nvjet GEMMs, grouped GEMMs), ``attention`` (flash
kernels), ``head`` (actorcore's fused log-prob kernels), ``copies`` (copies, memsets, concatenation, index
copies, outside Inductor's fused kernels), ``elementwise`` (everything else: pointwise, reductions, Inductor's and
Liger's fused kernels).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter

import torch

PEAK_TFLOPS = 790.0  # bf16 dense matmul rate measured on the H200 (NOTES.md)

_CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|attn_fwd|attn_bwd|_attn", re.I)),
    ("head", re.compile(r"(fwd_stats|bwd_grad_logits|shifted_to_grad|rows_stats|rows_grad)\w*kernel")),
    # Inductor's fused pointwise / reduction kernels are named after their ops (``_to_copy``, ``cat``, ``gather``,
    # and the GEMM custom ops they are fused next to): the work of each is elementwise, whatever its name holds.
    ("elementwise", re.compile(r"^triton_(poi|red|per)_")),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|sm90_xmma|cublas|wgmma|grouped_mm|_mm_|matmul|s16816|splitK", re.I)),
    ("copies", re.compile(r"copy|memset|memcpy|CatArray|cat_|index_put|scatter|gather|Memcpy|Memset|fill", re.I)),
)


def category(kernel_name: str) -> str:
    for name, pattern in _CATEGORIES:
        if pattern.search(kernel_name):
            return name
    return "elementwise"


def pack_greedy(sequences: list[torch.Tensor], max_tokens: int) -> list[list[torch.Tensor]]:
    """Sequences in order into packs of at most ``max_tokens`` tokens (a longer sequence gets a pack of its own)."""
    packs, current, size = [], [], 0
    for seq in sequences:
        if current and size + seq.numel() > max_tokens:
            packs.append(current)
            current, size = [], 0
        current.append(seq)
        size += seq.numel()
    if current:
        packs.append(current)
    return packs


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 3, warmup: int = 1) -> dict:
    """Median seconds and peak GiB (allocated, from the call's start) over ``repeats`` calls after warm-up."""
    first = None
    for i in range(warmup):
        start = time.perf_counter()
        fn()
        sync()
        if i == 0:
            first = time.perf_counter() - start
    times, peak = [], 0.0
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        if torch.cuda.is_available():
            peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
    return {"seconds": sorted(times)[len(times) // 2], "peak_gib": peak, "warmup_s": first}


def kernel_breakdown(fn, top: int = 40) -> tuple[dict, list]:
    """Kernel milliseconds per category for one call of ``fn``, and the ``top`` kernels with the most time."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {}, []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    per_kernel = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time / 1e3
    per_category = Counter()
    for name, ms in per_kernel.items():
        per_category[category(name)] += ms
    events = prof.events()
    idle_ms, _ = idle_gaps(events)
    per_category["gpu idle"] = idle_ms
    per_category["host before"], per_category["host after"] = host_edges(events)
    return dict(per_category), [(name[:90], category(name), round(ms, 1)) for name, ms in per_kernel.most_common(top)]


def idle_gaps(events, min_gap_us: float = 5.0) -> tuple[float, list]:
    """Milliseconds the GPU sat idle between the first kernel and the last (gaps over ``min_gap_us``), and each
    gap with the kernel that ended it: ``(gap µs, device event)``. The host's share of the step: launches slower than
    the kernels they launch, or synchronisations."""
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    gaps, end = [], None
    for kernel in kernels:
        if end is not None and kernel.time_range.start - end > min_gap_us:
            gaps.append((kernel.time_range.start - end, kernel))
        end = kernel.time_range.end if end is None else max(end, kernel.time_range.end)
    return sum(g for g, _ in gaps) / 1e3, gaps


def kernel_sources(fn, top: int = 30) -> tuple[list, list]:
    """Kernel milliseconds of one call of ``fn`` by where they were launched: the innermost frame of actorcore,
    megatron or transformers in the launching op's Python stack (forward), or the autograd node that ran it
    (backward, which has no Python stack); the ``top`` places with the most time, each with its op. Second, the GPU's
    idle time by the same places (``idle_sources``)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return [], []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn()
        sync()
    per_place = Counter()
    events = prof.events()
    for event in events:
        own = getattr(event, "self_device_time_total", 0)
        if event.device_type != torch.autograd.DeviceType.CPU or own <= 0:
            continue
        per_place[(_launch_place(event), event.name)] += own / 1e3
    return [(place, op, round(ms, 1)) for (place, op), ms in per_place.most_common(top)], idle_sources(events)


def host_edges(events) -> tuple[float, float]:
    """Milliseconds of the call before its first kernel starts and after its last kernel ends (the host's setup
    and wrap-up, with the GPU idle), from the first and last host op."""
    kernels = [e.time_range for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e.time_range for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if not kernels or not host:
        return 0.0, 0.0
    first, last = min(r.start for r in kernels), max(r.end for r in kernels)
    return max(0.0, first - min(r.start for r in host)) / 1e3, max(0.0, max(r.end for r in host) - last) / 1e3


def idle_sources(events, top: int = 20) -> list:
    """The GPU's idle gaps (``idle_gaps``) by where the kernel that ended each was launched (as ``kernel_sources``):
    the ``top`` places with the most idle milliseconds before their kernels, each with its op and gap count. Under a
    profile with stacks the host runs slower, so the gaps are larger than in a plain step; their places are the
    point."""
    ops = {e.id: e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.name.startswith("cuda")}
    per_place, counts = Counter(), Counter()
    for gap_us, kernel in idle_gaps(events)[1]:
        op = ops.get(getattr(kernel, "linked_correlation_id", 0))
        key = (_launch_place(op), op.name) if op is not None else ("?", kernel.name[:60])
        per_place[key] += gap_us / 1e3
        counts[key] += 1
    return [(place, op, round(ms, 1), counts[(place, op)]) for (place, op), ms in per_place.most_common(top)]


def _launch_place(event) -> str:
    frames = [f for f in (event.stack or []) if any(k in f for k in ("actorcore", "megatron", "transformers"))]
    if frames:
        return frames[0].split("site-packages/")[-1].split("/src/")[-1][:100]
    parent = event.cpu_parent
    while parent is not None and "evaluate_function" not in parent.name:
        parent = parent.cpu_parent
    return parent.name.replace("autograd::engine::evaluate_function: ", "backward ") if parent else "?"


def mfu(params_active: float, tokens: int, seconds: float) -> float:
    """6 x (active) parameters x tokens against the bf16 matmul rate (attention FLOPs not counted)."""
    return 6 * params_active * tokens / seconds / (PEAK_TFLOPS * 1e12)


def format_breakdown(per_category: dict) -> str:
    """Kernel time per category, each as a share of the kernel time; the GPU's idle time (between kernels, and
    before the first and after the last while the host works) after it, not in the sum."""
    order = ("matmul", "attention", "elementwise", "copies", "head")
    total = sum(per_category.get(k, 0) for k in order) or 1.0
    line = " ".join(f"{k} {per_category.get(k, 0):.0f}ms ({100 * per_category.get(k, 0) / total:.0f}%)" for k in order)
    idle = [f"{k} {per_category[k]:.0f}ms" for k in ("gpu idle", "host before", "host after") if k in per_category]
    return line + ("; " + ", ".join(idle) if idle else "")


def write_json(out_dir: str | None, name: str, obj) -> None:
    """``obj`` as ``out_dir/name`` (nothing without ``out_dir``), written under a temporary name and renamed."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def print_rows(rows: list, name_key: str, line) -> None:
    """One line per row (``line(row)``; an ``error`` row shows its error), then its kernel-time breakdown."""
    for row in rows:
        if "error" in row:
            print(f"{row[name_key]:<28} {row['error']}")
            continue
        print(f"{row[name_key]:<28} {line(row)}")
        if row.get("breakdown"):
            print(f"    {format_breakdown(row['breakdown'])}")
