"""The torch gated delta rule of one Gated DeltaNet layer: the whole-pack autograd path vs the blocks path.

One layer's delta rule on a packed batch, inputs as the layer gives them (q, k, v, beta bf16 on the GPU, g fp32),
forward only (no grad) and forward+backward (gradients of q, k, v, g, beta): time and peak memory above the
inputs for each path, and how far the blocks path's output and gradients are from the whole-pack path's (max
absolute for the output, max relative to the largest magnitude for each gradient). Peak memory: CUDA's
``max_memory_allocated``; on the CPU, the peak of live bytes from the profiler's allocation events.

The default shape is a Qwen3.5-2B Gated DeltaNet layer (16 key and 16 value heads of 128) on the batch of
``bench/hf_route.py --model qwen3.5-2b --max-len 8192`` (32 sequences of 128-8192 tokens, 159,221 tokens).

    PYTHONPATH=src python3 bench/delta_rule.py [--sequences 32 --min-len 128 --max-len 8192] [--out DIR]
    PYTHONPATH=src python3 bench/delta_rule.py --tiny        # a tiny shape on the CPU (to check the script)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

PATHS = ("whole_pack", "blocks")


def _run(path: str, inputs, cu_seqlens, scale: float, block_tokens: int):
    from actorcore.kernels.linear_attention.delta_rule_chunks import delta_rule_blocks, delta_rule_whole_pack

    if path == "whole_pack":
        return delta_rule_whole_pack(*inputs, cu_seqlens, True, scale).to(inputs[0].dtype)
    return delta_rule_blocks(*inputs, cu_seqlens, True, scale, block_tokens=block_tokens, out_dtype=inputs[0].dtype)


def _cpu_peak_bytes(fn) -> int:
    """Peak of live bytes allocated during ``fn`` (above what was live before), from the profiler's events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _measure(fn, device: str, repeats: int, warmup: bool) -> tuple[float, float, object]:
    """(median seconds, peak GiB above the memory live before, last result)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if warmup:
        fn()
        sync()
    times, result = [], None
    for _ in range(repeats):
        result = None
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    if device == "cuda":
        result = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        holder = []
        peak = _cpu_peak_bytes(lambda: holder.append(fn()))
        result = holder[0]
    return statistics.median(times), peak / 2**30, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--key-heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-tokens", default=None,
                        help="the blocks path's slots per block, comma-separated to run each (default: the library's)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per cell (3 on CUDA, 1 on the CPU)")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (to check the script)")
    parser.add_argument("--out", default=None, help="folder for delta_rule.json")
    args = parser.parse_args()

    from actorcore.kernels.linear_attention.delta_rule_chunks import BLOCK_TOKENS

    if args.tiny:
        args.sequences, args.min_len, args.max_len = 5, 1, 300
        args.key_heads, args.value_heads, args.head_dim = 2, 4, 16
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    repeats = args.repeats or (3 if device == "cuda" else 1)
    block_sizes = [int(b) for b in args.block_tokens.split(",")] if args.block_tokens else [
        128 if args.tiny else BLOCK_TOKENS]
    g = torch.Generator().manual_seed(1)  # the lengths bench/hf_route.py draws first
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.sequences,), generator=g).tolist()
    T, N, M, D = sum(lengths), args.key_heads, args.value_heads, args.head_dim
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    dtype = torch.bfloat16
    with torch.device(device):
        torch.manual_seed(0)
        inputs = [torch.randn(T, N, D, dtype=dtype), torch.randn(T, N, D, dtype=dtype),
                  torch.randn(T, M, D, dtype=dtype), -torch.rand(T, M) * 0.5, torch.rand(T, M).to(dtype)]
        grad_out = torch.randn(T, M, D, dtype=dtype)
    inputs = [x.requires_grad_() for x in inputs]
    scale = D**-0.5
    print(f"device {device}, {len(lengths)} sequences of {min(lengths)}-{max(lengths)} tokens ({T} tokens), "
          f"{N} key / {M} value heads of {D}", flush=True)

    def forward(path, block_tokens):
        with torch.no_grad():
            return _run(path, inputs, cu, scale, block_tokens)

    def train(path, block_tokens):
        out = _run(path, inputs, cu, scale, block_tokens)
        return (out.detach(), *torch.autograd.grad(out, inputs, grad_out))

    cells = []
    for path in args.paths.split(","):
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; choose from {PATHS}")
        cells += [(path, None)] if path == "whole_pack" else [(path, b) for b in block_sizes]
    rows, results = {}, {}
    for path, block_tokens in cells:
        name = path if block_tokens is None else f"{path} {block_tokens}"
        for mode, fn in (("fwd", forward), ("fwd+bwd", train)):
            seconds, peak, result = _measure(lambda: fn(path, block_tokens), device, repeats,
                                             warmup=device == "cuda")
            rows[f"{name} {mode}"] = {"seconds": seconds, "peak_gib": peak}
            results[name] = result
            print(f"[cell] {name} {mode}: {seconds:.3f} s, peak {peak:.3f} GiB above the inputs", flush=True)
    if "whole_pack" in results:
        a = results["whole_pack"]
        for name in [n for n in results if n != "whole_pack"]:
            b = results[name]
            diffs = {"out_max_abs": (a[0].float() - b[0].float()).abs().max().item()}
            for grad, x, y in zip(("q", "k", "v", "g", "beta"), a[1:], b[1:]):
                diffs[f"grad_{grad}_max_rel"] = ((x.float() - y.float()).abs().max() / x.float().abs().max()).item()
            rows[f"{name} vs whole_pack"] = diffs
            print(f"{name} vs whole_pack (bf16 outputs and gradients: one rounding step is up to 8e-3 relative):",
                  {k: f"{v:.2e}" for k, v in diffs.items()})
            for mode in ("fwd", "fwd+bwd"):
                old, new = rows[f"whole_pack {mode}"], rows[f"{name} {mode}"]
                print(f"{mode}: {name} takes {new['seconds'] / old['seconds']:.2f}x the time and "
                      f"{new['peak_gib'] / max(old['peak_gib'], 1e-12):.3f}x the peak memory of whole_pack")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"device": device, "lengths": lengths, "tokens": T, "key_heads": N, "value_heads": M, "head_dim": D,
                "block_tokens": block_sizes, "repeats": repeats}
        tmp = os.path.join(args.out, "delta_rule.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        os.replace(tmp, os.path.join(args.out, "delta_rule.json"))


if __name__ == "__main__":
    main()
