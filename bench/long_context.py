"""Long context on one GPU: one sequence, forward+backward of the log-prob loss, with and without activation offload.

A Llama-8B-shaped model (hidden 4096, MLP 14336, 32 heads / 8 kv heads, vocabulary 128256), randomly initialised,
bf16 parameters, gradient checkpointing (non-reentrant) on every layer. Variants:

- ``actorcore``: ``ac.compute_loss`` (packed attention, loss-fused head), tiled MLP (``--shards``);
- ``offload``: the same with ``patch_model(..., offload_activations=True)``;
- ``transformers``: the plain model (SDPA), its logits, ``log_softmax`` in fp32, the summed log-prob as the loss.

``--layers N`` builds only N decoder layers so one run stays short; the JSON and the table say how many were used
and add estimates for the full 32 layers, labelled as such: time x 32/N (an upper bound: the embedding and head
are counted 32/N times), peak + (32 - N) x (per-layer parameters and gradients, plus the layer's checkpointed
input T x 4096 x 2 bytes unless offloaded). Each cell catches out-of-memory; an offload cell whose pinned host
memory would not fit in the machine's available memory is skipped with the numbers. ``--memory-history``
records ``torch.cuda.memory`` history during the first step of the offload variant (else actorcore) at the
longest length and summarises what is live at the peak, by size and allocation site. Results go to
``--out``.json and ``--out``.md, rewritten after every cell.

    PYTHONPATH=src python3 bench/long_context.py --lengths 131072,262144 --layers 4 --out /tmp/long_context
    PYTHONPATH=src python3 bench/long_context.py --tiny --out /tmp/long_context_tiny     # CPU, checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections import Counter, defaultdict

import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False,
                max_position_embeddings=1 << 21)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=8192)
FULL_LAYERS = 32
VARIANTS = ("transformers", "actorcore", "offload")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _enable_checkpointing(model) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _neg_logprob(logprob, entropy):
    return -logprob


def _actorcore_step(model, ids):
    import actorcore as ac

    trace = Counter()
    out = ac.compute_loss(model, ac.pack([ids]), _neg_logprob, entropy=False, trace=trace)
    out.loss.backward()
    return trace


def _transformers_step(model, ids):
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
    logprob = torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])
    (-logprob.sum()).backward()
    return Counter()


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def summarize_memory_history(snapshot: dict, top: int = 15) -> dict:
    """Replay the recorded allocations; what is live at the peak, grouped by size and allocation site."""
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for device_trace in snapshot.get("device_traces", []):
        for event in device_trace:
            action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
            if action == "alloc":
                live[addr] = (size, _site(event.get("frames", [])))
                current += size
                if current > peak:
                    peak, at_peak = current, dict(live)
            elif action in ("free_requested", "free") and addr in live:
                current -= live.pop(addr)[0]
    groups: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        groups[(size, site)][0] += 1
        groups[(size, site)][1] += size
    rows = sorted(({"size_mib": size / 2**20, "count": n, "total_gib": total / 2**30, "site": site}
                   for (size, site), (n, total) in groups.items()), key=lambda r: -r["total_gib"])
    return {"peak_during_recording_gib": peak / 2**30, "live_at_peak": rows[:top],
            "other_gib": sum(r["total_gib"] for r in rows[top:])}


def _site(frames: list) -> str:
    """The first frame in actorcore or transformers code (else the first Python frame): who allocated."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    for f in python:
        name = str(f.get("filename", ""))
        if "/actorcore/" in name or "/transformers/" in name:
            return f"{name.split('/site-packages/')[-1].split('/src/')[-1]}:{f.get('line')} {f.get('name')}"
    if python:
        f = python[0]
        return f"{str(f.get('filename')).split('/site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)"


def _write(results: dict, out: str) -> None:
    """Atomic writes of ``out``.json and ``out``.md."""
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    for suffix, text in ((".json", json.dumps(results, indent=1)), (".md", _markdown(results))):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".long_context")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out + suffix)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _markdown(results: dict) -> str:
    setup = results["setup"]
    lines = [f"# Long context: {setup['model']}, {setup['layers']} of {FULL_LAYERS} layers built, "
             f"{setup['device']}", "",
             f"One sequence, forward+backward of the log-prob loss, bf16 parameters, gradient checkpointing; tiled "
             f"MLP {setup['shards']} shards for actorcore. Warm-up steps {setup['warmup']}, timed {setup['repeats']} "
             "(median). `32L` columns are estimates from the layers built (time x 32/N, an upper bound; peak + the "
             "missing layers' parameters, gradients and, without offload, checkpointed inputs).", "",
             "| variant | tokens | seconds | tokens/s | peak GiB | est. 32L seconds | est. 32L peak GiB | "
             "offloaded GiB (32L) | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in results["cells"]:
        lines.append(f"| {c['variant']} | {c['tokens']} | {_fmt(c.get('seconds'), '.2f')} | "
                     f"{_fmt(c.get('tokens_per_s'), '.0f')} | {_fmt(c.get('peak_gib'), '.1f')} | "
                     f"{_fmt(c.get('est_full_seconds'), '.1f')} | {_fmt(c.get('est_full_peak_gib'), '.1f')} | "
                     f"{_fmt(c.get('offload_host_gib_full'), '.0f')} | {c.get('status', '')} |")
    history = results.get("memory_history")
    if history:
        lines += ["", f"## Live at the peak: {history['variant']} at {history['tokens']} tokens "
                  f"({history['peak_during_recording_gib']:.1f} GiB allocated during the step, "
                  f"{history['allocated_before_gib']:.1f} GiB before it: parameters, gradients, inputs)", "",
                  "| size MiB | count | total GiB | allocated at |", "|---|---|---|---|"]
        for r in history["live_at_peak"]:
            lines.append(f"| {r['size_mib']:.1f} | {r['count']} | {r['total_gib']:.2f} | `{r['site']}` |")
        lines.append(f"| | | {history['other_gib']:.2f} | (everything else) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import actorcore as ac
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="131072,262144,524288", help="comma-separated sequence lengths")
    parser.add_argument("--transformers-lengths", default="32768,65536",
                        help="lengths at which the plain transformers variant runs")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--layers", type=int, default=None, help=f"decoder layers to build (default {FULL_LAYERS})")
    parser.add_argument("--shards", type=int, default=8, help="tiled-MLP shards")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-history", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (checks the script)")
    parser.add_argument("--out", required=True, help="path prefix of the .json and .md results")
    args = parser.parse_args()

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    lengths = [int(x) for x in args.lengths.split(",") if x]
    plain_lengths = {int(x) for x in args.transformers_lengths.split(",") if x}
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if args.tiny:
        lengths, plain_lengths = [256, 512], {256}
    if args.layers is None:
        args.layers = TINY["num_hidden_layers"] if args.tiny else FULL_LAYERS
    shape = dict(TINY if args.tiny else LLAMA_8B, num_hidden_layers=args.layers)
    config = AutoConfig.for_model("llama", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    _enable_checkpointing(model)
    model.train()
    hidden = config.hidden_size
    layer_params = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    results = {"setup": {"model": "tiny llama" if args.tiny else "Llama-8B shape", "layers": args.layers,
                         "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                         "shards": args.shards, "warmup": args.warmup, "repeats": args.repeats,
                         "torch": torch.__version__, "host_available_gib": (_host_available_bytes() or 0) / 2**30},
               "cells": []}
    g = torch.Generator().manual_seed(1)
    longest = max(lengths)
    history_variant = "offload" if "offload" in variants else "actorcore"
    for tokens in sorted(set(lengths) | (plain_lengths if "transformers" in variants else set())):
        ids = torch.randint(0, config.vocab_size, (tokens,), generator=g).to(device)
        for variant in variants:
            if tokens not in (plain_lengths if variant == "transformers" else lengths):
                continue
            cell = {"variant": variant, "tokens": tokens, "layers": args.layers}
            checkpoint_bytes = tokens * hidden * 2
            if variant == "offload" and device == "cuda":
                need = FULL_LAYERS * checkpoint_bytes
                cell["offload_host_gib_full"] = need / 2**30
                available = _host_available_bytes()
                # torch's pinned-memory cache rounds each block up to a power of two
                pinned = args.layers * (1 << (checkpoint_bytes - 1).bit_length())
                if available is not None and pinned > 0.9 * available:
                    cell["status"] = (f"skipped: {args.layers} layers need {pinned / 2**30:.0f} GiB pinned host "
                                      f"memory, {available / 2**30:.0f} GiB available")
                    results["cells"].append(cell)
                    _write(results, args.out)
                    continue
            handle = None
            if variant != "transformers":
                handle = ac.patch_model(model, tiled_mlp_shards=args.shards,
                                        offload_activations=variant == "offload")
            step = _transformers_step if variant == "transformers" else _actorcore_step
            record = args.memory_history and device == "cuda" and tokens == longest and variant == history_variant
            try:
                times, peak, trace = [], 0, Counter()
                for i in range(args.warmup + args.repeats):
                    model.zero_grad(set_to_none=True)
                    gc.collect()
                    if device == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    recording = record and i == 0
                    if recording:
                        before = torch.cuda.memory_allocated()
                        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
                    start = time.perf_counter()
                    trace = step(model, ids)
                    _sync()
                    elapsed = time.perf_counter() - start
                    if recording:
                        snapshot = torch.cuda.memory._snapshot()
                        torch.cuda.memory._record_memory_history(enabled=None)
                        results["memory_history"] = dict(
                            summarize_memory_history(snapshot), variant=variant, tokens=tokens,
                            allocated_before_gib=before / 2**30, timed=i >= args.warmup)
                        del snapshot
                    if i >= args.warmup:
                        times.append(elapsed)
                        if device == "cuda":
                            peak = max(peak, torch.cuda.max_memory_allocated())
                seconds = sorted(times)[len(times) // 2]
                cell.update(seconds=seconds, tokens_per_s=tokens / seconds, status="ok",
                            offload_trace={k: v for k, v in trace.items() if k.startswith("offload:")})
                if device == "cuda":
                    missing = FULL_LAYERS - args.layers
                    per_layer = 2 * layer_params + (0 if variant == "offload" else checkpoint_bytes)
                    cell.update(peak_gib=peak / 2**30, est_full_peak_gib=(peak + missing * per_layer) / 2**30,
                                est_full_seconds=seconds * FULL_LAYERS / args.layers)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not _is_oom(exc):
                    raise
                cell["status"] = "out of memory"
                if record:
                    torch.cuda.memory._record_memory_history(enabled=None)
                del exc
            finally:
                model.zero_grad(set_to_none=True)
                if handle is not None:
                    handle.revert()
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            results["cells"].append(cell)
            _write(results, args.out)
            print(f"{variant:>12} {tokens:>8} tokens: {cell['status']} {_fmt(cell.get('seconds'), '.2f')} s "
                  f"peak {_fmt(cell.get('peak_gib'), '.1f')} GiB", flush=True)
    print(_markdown(results))


if __name__ == "__main__":
    main()
