"""Cost and effect of ``batch_invariant=True`` on the B2-style batch (bench/hf_route.py's model and batch).

One process, one GPU, a randomly initialised Qwen2.5-1.5B-shaped model, bf16, activation checkpointing, an RL-like
batch of 32 sequences of 128-4096 tokens. Measures, with the mode off and on:
- forward-only and forward+backward time of ``compute_logprobs`` over the whole batch (median of ``--repeats``);
- the max |Δ| of each sequence's log-probs and entropies across three packings of the same sequences (the batch
  as given; reversed; shuffled and split into two micro-batches of different token counts), forward-only and in
  a training forward (grad enabled, then backward): 0 means bitwise batch-invariant.

    PYTHONPATH=src python3 bench/batch_invariant.py --out $OUT/batch_invariant     # H200
    PYTHONPATH=src python3 bench/batch_invariant.py --tiny --out /tmp/bi            # CPU check of the script

Writes ``batch_invariant.json`` and ``batch_invariant.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_route import QWEN25_15B, TINY, model_and_sequences  # noqa: E402  (the B2 model shapes, one table)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    _sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _write_atomic(path: str, text: str) -> None:
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def bi_tile_rows() -> str:
    """The linears' tile rows the mode runs with: one number, or the library's rule by output width."""
    import actorcore.hf.features.batch_invariant as bi
    from actorcore.kernels.batch_invariant import linear_tile_rows

    fixed = bi.batch_invariant_decoder.__defaults__[0]
    if fixed is not None:
        return f"{fixed} rows"
    widths = {"q/o and down (1536 outputs)": 1536, "k/v (256)": 256, "gate/up (8960)": 8960}
    return ", ".join(f"{name} {linear_tile_rows(n)} rows" for name, n in widths.items())


def _profile(step, title: str, rows: int = 40) -> str:
    """One call of ``step`` under torch.profiler: the table of the ops with the most device (else CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    step()  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
        _sync()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return f"## {title}\n" + prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70)


def main() -> None:
    import actorcore as ac

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (to check the script)")
    parser.add_argument("--out", required=True, help="folder for batch_invariant.json and batch_invariant.md")
    parser.add_argument("--tile-rows", type=int, default=None,
                        help="rows per tile of every invariant linear (default: the library's rule, "
                             "linear_tile_rows of each linear's output width)")
    parser.add_argument("--profile", action="store_true",
                        help="also write profile.txt: one forward+backward per mode under torch.profiler, the ops "
                             "and kernels that take the most device time")
    args = parser.parse_args()
    if args.tiny:
        args.sequences, args.min_len, args.max_len = min(args.sequences, 6), min(args.min_len, 3), min(args.max_len, 60)

    if args.tile_rows is not None:  # the mode's tile size has no public knob: set the default the call uses
        import actorcore.hf.features.batch_invariant as bi

        bi.batch_invariant_decoder.__defaults__ = (args.tile_rows, bi.NORM_TILE_ROWS, None)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    model, sequences, g = model_and_sequences("qwen2", TINY if args.tiny else QWEN25_15B, device, args.sequences,
                                           args.min_len, args.max_len, checkpointing={"use_reentrant": False})
    dtype = model.dtype
    lengths = [len(s) for s in sequences]
    whole = ac.pack(sequences).to(device)

    def logprobs(batch, invariant: bool, train: bool):
        model.train(train)
        with torch.set_grad_enabled(train):
            out = ac.compute_logprobs(model, batch, batch_invariant=invariant)
            if train:
                (out.log_probs.sum() + out.entropy.sum()).backward()
                model.zero_grad(set_to_none=True)
        return out.log_probs.detach(), out.entropy.detach()

    # Three packings of the same sequences: as given; reversed; shuffled into two micro-batches of unequal size.
    order = torch.randperm(len(sequences), generator=g).tolist()
    cut = max(1, len(order) // 3)
    packings = {"as given": [list(range(len(sequences)))], "reversed": [list(range(len(sequences)))[::-1]],
                "shuffled, 2 micro-batches": [order[:cut], order[cut:]]}

    def per_sequence(invariant: bool, train: bool, packing: list[list[int]]):
        outs = {}
        for group in packing:
            batch = ac.pack([sequences[i] for i in group]).to(device)
            lp, ent = logprobs(batch, invariant, train)
            bounds = batch.cu_seqlens.tolist()
            for k, i in enumerate(group):
                outs[i] = (lp[bounds[k]:bounds[k + 1]], ent[bounds[k]:bounds[k + 1]])
        return outs

    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
                     "model": "qwen2 tiny" if args.tiny else "qwen2 (Qwen2.5-1.5B shape)",
                     "sequences": len(sequences), "tokens": whole.num_tokens, "min_len": min(lengths),
                     "max_len": max(lengths), "activation_checkpointing": True,
                     "tile_rows": bi_tile_rows(), "timing": {}, "max_abs_diff": {}}
    for invariant in (False, True):
        mode = "batch_invariant" if invariant else "plain"
        for train in (False, True):
            key = f"{mode} {'fwd+bwd' if train else 'fwd'}"
            results["timing"][key] = _median_seconds(lambda: logprobs(whole, invariant, train), args.repeats)
            runs = {name: per_sequence(invariant, train, p) for name, p in packings.items()}
            base = runs["as given"]
            worst_lp = max((r[i][0] - base[i][0]).abs().max().item() for r in runs.values() for i in base)
            worst_ent = max((r[i][1] - base[i][1]).abs().max().item() for r in runs.values() for i in base)
            results["max_abs_diff"][key] = {"log_probs": worst_lp, "entropy": worst_ent}
    os.makedirs(args.out, exist_ok=True)
    if args.profile:
        _write_atomic(os.path.join(args.out, "profile.txt"),
                      "\n\n".join(_profile(lambda: logprobs(whole, invariant, True), f"batch_invariant={invariant}")
                                   for invariant in (False, True)))
    timing = results["timing"]
    results["cost"] = {phase: timing[f"batch_invariant {phase}"] / timing[f"plain {phase}"] - 1
                       for phase in ("fwd", "fwd+bwd")}

    lines = ["# batch_invariant=True: cost and packing invariance", "",
             f"{results['device']}, {dtype}, {results['model']}, {len(sequences)} sequences of "
             f"{min(lengths)}-{max(lengths)} tokens ({whole.num_tokens} tokens), activation checkpointing, "
             f"invariant linears in tiles of {results['tile_rows']}; "
             f"median of {args.repeats}. Packings: as given, reversed, shuffled into two micro-batches.", "",
             "| mode | phase | time | tokens/s | max abs diff log-prob across packings | entropy |",
             "|---|---|---|---|---|---|"]
    for key, seconds in timing.items():
        mode, phase = key.split(" ")
        diff = results["max_abs_diff"][key]
        lines.append(f"| {mode} | {phase} | {seconds * 1e3:.1f} ms | {whole.num_tokens / seconds:,.0f} | "
                     f"{diff['log_probs']:.3g} | {diff['entropy']:.3g} |")
    lines += ["", "Cost of the mode: " + ", ".join(f"{phase} {100 * c:+.1f}%" for phase, c in results["cost"].items()),
              ""]
    os.makedirs(args.out, exist_ok=True)
    _write_atomic(os.path.join(args.out, "batch_invariant.json"), json.dumps(results, indent=1) + "\n")
    _write_atomic(os.path.join(args.out, "batch_invariant.md"), "\n".join(lines))
    sys.stdout.write("\n".join(lines))


if __name__ == "__main__":
    main()
