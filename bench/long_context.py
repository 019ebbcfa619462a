"""Long context on one GPU, or on several with Ulysses SP: one sequence, forward+backward of the log-prob loss, with
and without activation offload.

A Llama-8B-shaped model (hidden 4096, MLP 14336, 32 heads / 8 kv heads, vocabulary 128256), randomly initialised,
bf16 parameters, gradient checkpointing (non-reentrant) on every layer. Variants:

- ``actorcore``: ``ac.compute_loss`` (packed attention, loss-fused head), tiled MLP (``--shards``);
- ``offload``: the same with ``patch_model(..., offload_activations=...)``: all layers (``--offload-layers all``),
  the first K (an int), or ``auto``: as many leading layers as fit in 85% of the host's available memory (shared
  by the ranks of the host);
- ``transformers``: the plain model (SDPA), its logits, ``log_softmax`` in fp32, the summed log-prob as the loss.

``--sp N`` (launched with ``torchrun --nproc-per-node N``): Ulysses sequence parallelism over the N processes
(NCCL on CUDA, gloo on the CPU), ``patch_model(parallel=ctx)`` with tiled MLP (and offload); the loss is the summed
log-prob of ``ac.compute_logprobs(..., parallel=ctx)`` (``compute_loss`` does not run under SP). Each rank keeps
its 1/N of the tokens' checkpointed inputs; peak memory is reported per rank (the table shows the largest) and
rank 0 writes the results. An out-of-memory on one rank can leave the others waiting in a collective: the process
group's ``--timeout`` ends them.

``--layers N`` builds only N decoder layers so one run stays short; the JSON and the table say how many were used
and add estimates for the full 32 layers, labelled as such: time x 32/N (an upper bound: the embedding and head
are counted 32/N times), peak + (32 - N) x the per-layer parameters and gradients + the checkpointed inputs
(T/SP x 4096 x 2 bytes each) of the missing layers that would not be offloaded. ``--offload-layers`` counts layers
of the 32-layer model, whose first ones the layers built stand for (K >= N: every built layer offloads). Each cell
catches out-of-memory; an offload cell whose pinned host memory (all ranks on the host) would not fit in the
machine's available memory is skipped with the numbers. ``--memory-history`` records ``torch.cuda.memory``
history during the first step of the offload variant (else actorcore) at the longest length and summarises what is
live at the peak, by size and allocation site. Results go to ``--out``.json and ``--out``.md (rank 0), rewritten
after every cell.

    PYTHONPATH=src python3 bench/long_context.py --lengths 131072,262144 --layers 4 --out /tmp/long_context
    PYTHONPATH=src python3 bench/long_context.py --tiny --out /tmp/long_context_tiny     # CPU, checks the script
    PYTHONPATH=src torchrun --nproc-per-node 2 bench/long_context.py --sp 2 --lengths 1048576 --layers 1 \
        --variants offload --offload-layers auto --warmup 0 --out /tmp/long_context_sp2
    PYTHONPATH=src torchrun --nproc-per-node 2 bench/long_context.py --sp 2 --tiny --out /tmp/lc_sp2_tiny   # gloo
"""

from __future__ import annotations

import argparse
import datetime
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


def _actorcore_step(model, ids, parallel=None):
    import actorcore as ac

    trace = Counter()
    if parallel is None:
        out = ac.compute_loss(model, ac.pack([ids]), _neg_logprob, entropy=False, trace=trace)
        out.loss.backward()
    else:  # compute_loss does not run under SP: the summed log-prob of the gathered [T] outputs
        out = ac.compute_logprobs(model, ac.pack([ids]), entropy=False, parallel=parallel, trace=trace)
        (-out.log_probs.sum()).backward()
    return trace


def _transformers_step(model, ids, parallel=None):
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
    sp = setup.get("sp", 1)
    lines = [f"# Long context: {setup['model']}, {setup['layers']} of {FULL_LAYERS} layers built, "
             f"{setup['device']}" + (f", Ulysses SP={sp} on {sp} processes" if sp > 1 else ""), "",
             f"One sequence, forward+backward of the log-prob loss, bf16 parameters, gradient checkpointing; tiled "
             f"MLP {setup['shards']} shards for actorcore. Warm-up steps {setup['warmup']}, timed {setup['repeats']} "
             "(median). `32L` columns are estimates from the layers built (time x 32/N, an upper bound; peak + the "
             "missing layers' parameters, gradients and, for the layers not offloaded, checkpointed inputs)."
             + (" Peak memory: the largest over the ranks (the JSON has each rank's)." if sp > 1 else ""), "",
             "| variant | tokens | offloaded layers (built, 32L) | seconds | tokens/s | peak GiB | est. 32L seconds | "
             "est. 32L peak GiB | host GiB offloaded (32L, all ranks) | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in results["cells"]:
        offloaded = f"{c['offload_layers']}, {c['offload_layers_full']}" if "offload_layers" in c else "-"
        lines.append(f"| {c['variant']} | {c['tokens']} | {offloaded} | "
                     f"{_fmt(c.get('seconds'), '.2f')} | "
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


def _offload_count(spec: str) -> int | None:
    """``--offload-layers``: of the full 32-layer model, all, the first K, or auto (None: decided per length)."""
    if spec in ("all", "auto"):
        return FULL_LAYERS if spec == "all" else None
    count = int(spec)
    if not 1 <= count <= FULL_LAYERS:
        raise SystemExit(f"--offload-layers {count} must be between 1 and {FULL_LAYERS} (or all, auto)")
    return count


def _distributed(args):
    """(rank, world size, ParallelContext or None, device) for ``--sp``; initialises the process group."""
    if args.sp == 1:
        return 0, 1, None, "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    import torch.distributed as dist

    import actorcore as ac

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.sp:
        raise SystemExit(f"--sp {args.sp} needs {args.sp} processes: launch with torchrun --nproc-per-node {args.sp}"
                         f" (WORLD_SIZE is {world})")
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    ctx = ac.ParallelContext(sp_group=dist.new_group(list(range(world))))
    return dist.get_rank(), world, ctx, "cuda" if cuda else "cpu"


def _agree(value, world: int):
    """Rank 0's value on every rank (decisions that read the host's memory must match across ranks)."""
    if world == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value, world: int) -> list:
    if world == 1:
        return [value]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def main() -> None:
    import actorcore as ac
    from actorcore.hf.offload import host_bytes
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="131072,262144,524288", help="comma-separated sequence lengths")
    parser.add_argument("--transformers-lengths", default="32768,65536",
                        help="lengths at which the plain transformers variant runs")
    parser.add_argument("--variants", default=None, help=f"comma-separated, from {VARIANTS} (default: all; with "
                        "--sp > 1 actorcore,offload)")
    parser.add_argument("--layers", type=int, default=None, help=f"decoder layers to build (default {FULL_LAYERS})")
    parser.add_argument("--shards", type=int, default=8, help="tiled-MLP shards")
    parser.add_argument("--offload-layers", default="all", help="offload variant: all, auto, or K: the first K of "
                        f"the {FULL_LAYERS}-layer model (the layers built are its first ones)")
    parser.add_argument("--sp", type=int, default=1, help="Ulysses SP size (launch with torchrun)")
    parser.add_argument("--timeout", type=int, default=150, help="--sp: process-group timeout in seconds")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--memory-history", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (checks the script)")
    parser.add_argument("--out", required=True, help="path prefix of the .json and .md results")
    args = parser.parse_args()

    rank, world, parallel, device = _distributed(args)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    plain_lengths = {int(x) for x in args.transformers_lengths.split(",") if x}
    default_variants = VARIANTS if args.sp == 1 else ("actorcore", "offload")
    variants = [v for v in (args.variants.split(",") if args.variants else default_variants) if v]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if args.sp > 1 and "transformers" in variants:
        raise SystemExit("the plain transformers variant does not run under --sp (it cannot split the sequence)")
    if args.tiny:
        lengths, plain_lengths = [256, 512], {256}
    if args.layers is None:
        args.layers = TINY["num_hidden_layers"] if args.tiny else FULL_LAYERS
    offload_count = _offload_count(args.offload_layers)
    shape = dict(TINY if args.tiny else LLAMA_8B, num_hidden_layers=args.layers)
    config = AutoConfig.for_model("llama", **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    _enable_checkpointing(model)
    model.train()
    hidden = config.hidden_size
    layer_params = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))  # ranks sharing this host's memory
    results = {"setup": {"model": "tiny llama" if args.tiny else "Llama-8B shape", "layers": args.layers,
                         "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                         "sp": args.sp, "shards": args.shards, "warmup": args.warmup, "repeats": args.repeats,
                         "offload_layers": args.offload_layers, "torch": torch.__version__,
                         "host_available_gib": (_host_available_bytes() or 0) / 2**30},
               "cells": []}
    write = (lambda: _write(results, args.out)) if rank == 0 else (lambda: None)
    g = torch.Generator().manual_seed(1)
    longest = max(lengths)
    history_variant = "offload" if "offload" in variants else "actorcore"
    for tokens in sorted(set(lengths) | (plain_lengths if "transformers" in variants else set())):
        ids = torch.randint(0, config.vocab_size, (tokens,), generator=g).to(device)
        for variant in variants:
            if tokens not in (plain_lengths if variant == "transformers" else lengths):
                continue
            cell = {"variant": variant, "tokens": tokens, "layers": args.layers, "sp": args.sp}
            checkpoint_bytes = -(-tokens // args.sp) * hidden * 2  # one layer's checkpointed input on one rank
            offload = offload_full = 0
            if variant == "offload":
                per_layer_host = host_bytes(checkpoint_bytes) * local_world  # every rank on this host
                available = _agree(_host_available_bytes(), world)
                offload_full = offload_count
                if offload_full is None:  # auto: as many leading layers of the full model as fit
                    offload_full = (min(FULL_LAYERS, int(0.85 * available) // per_layer_host) if available
                                    else FULL_LAYERS)
                offload = min(offload_full, args.layers)
                cell.update(offload_layers=offload, offload_layers_full=offload_full,
                            offload_host_gib_full=offload_full * per_layer_host / 2**30)
                if device == "cuda" and available is not None and (offload == 0
                                                                   or offload * per_layer_host > 0.9 * available):
                    cell["status"] = (f"skipped: {max(offload, 1)} layers need "
                                      f"{max(offload, 1) * per_layer_host / 2**30:.0f} GiB pinned host memory "
                                      f"({local_world} ranks), {available / 2**30:.0f} GiB available")
                    results["cells"].append(cell)
                    write()
                    continue
            handle = None
            if variant != "transformers":
                handle = ac.patch_model(model, parallel=parallel, tiled_mlp_shards=args.shards,
                                        offload_activations=offload or False)
            step = _transformers_step if variant == "transformers" else _actorcore_step
            record = (args.memory_history and device == "cuda" and rank == 0 and tokens == longest
                      and variant == history_variant)
            oom = False
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
                    trace = step(model, ids, parallel)
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
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not _is_oom(exc):
                    raise
                oom = True
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
            ranks = _gather({"oom": oom, "times": times, "peak": peak}, world)
            if any(r["oom"] for r in ranks):
                cell["status"] = "out of memory" + (f" (ranks {[i for i, r in enumerate(ranks) if r['oom']]})"
                                                    if world > 1 else "")
            else:
                # A step ends when the slowest rank's does; the median over the repeats of that.
                steps = sorted(max(step_times) for step_times in zip(*(r["times"] for r in ranks)))
                seconds = steps[len(steps) // 2]
                cell.update(seconds=seconds, tokens_per_s=tokens / seconds, status="ok",
                            offload_trace={k: v for k, v in trace.items() if k.startswith("offload:")})
                if device == "cuda":
                    peak = max(r["peak"] for r in ranks)
                    missing = FULL_LAYERS - args.layers
                    kept_missing = (FULL_LAYERS - offload_full) - (args.layers - offload)  # inputs left on the GPU
                    extra = missing * 2 * layer_params + kept_missing * checkpoint_bytes
                    cell.update(peak_gib=peak / 2**30, est_full_peak_gib=(peak + extra) / 2**30,
                                est_full_seconds=seconds * FULL_LAYERS / args.layers)
                    if world > 1:
                        cell["peak_gib_per_rank"] = [r["peak"] / 2**30 for r in ranks]
            results["cells"].append(cell)
            write()
            if rank == 0:
                print(f"{variant:>12} {tokens:>8} tokens: {cell['status']} {_fmt(cell.get('seconds'), '.2f')} s "
                      f"peak {_fmt(cell.get('peak_gib'), '.1f')} GiB", flush=True)
    if rank == 0:
        print(_markdown(results))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
