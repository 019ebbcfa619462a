"""What the compiled decoder's compiled layers keep for backward, with and without the partitioner setting
(``hf.features.compiled_decoder.recompute_pointwise``), and the actor step it allows at several pack sizes.

Per setting, in one process: activation bytes per token and decoder layer = (allocated after the forward of one
32K-token pack without checkpointing - the same with full checkpointing) / tokens / layers; then the step of
``actor_step.py`` (forward+backward of -log p x advantage over the RL batch) without checkpointing, in packs of
each size: s/step, tokens/s, MFU, peak. The setting is switched off for its row by replacing the library's context
with a null one (a benchmark-only toggle: the library has no switch for it).

    PYTHONPATH=src python3 bench/activation_bytes.py --model qwen2.5-1.5b [--layers N] [--packs 32768,20480]
    PYTHONPATH=src python3 bench/activation_bytes.py --model qwen2.5-1.5b --bytes-only    # the library's setting, bytes only
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from actor_step import MODELS, active_parameters, actorcore_step, batch_sequences, build  # noqa: E402
from step_profile import mfu, pack_greedy, sync, write_json  # noqa: E402


def packs_of(sequences, advantages, max_tokens):
    packs, advs, start = [], [], 0
    for pack in pack_greedy([torch.arange(s.numel()) for s in sequences], max_tokens):
        packs.append(sequences[start: start + len(pack)])
        advs.append(advantages[start: start + len(pack)])
        start += len(pack)
    return packs, advs


def forward_bytes(ac, model, pack, adv, checkpointing, device):
    """Allocated bytes held after the forward of one pack (a warm-up call first, which compiles)."""
    handle = ac.patch_model(model, checkpointing=checkpointing)
    batch, adv = ac.pack(pack).to(device), torch.cat(adv).to(device)
    try:
        for measured in (False, True):
            model.zero_grad(set_to_none=True)
            sync()
            before = torch.cuda.memory_allocated() if device == "cuda" else 0
            res = ac.compute_loss(model, batch, lambda lp, ent, a: -(lp * a), (adv,), entropy=False)
            sync()
            held = (torch.cuda.memory_allocated() if device == "cuda" else 0) - before
            res.loss.backward()
            del res
    finally:
        model.zero_grad(set_to_none=True)
        handle.revert()
        gc.collect()
    return held, batch.num_tokens


def step_row(ac, model, sequences, advantages, max_tokens, active, device):
    packs, advs = packs_of(sequences, advantages, max_tokens)
    handle = ac.patch_model(model, checkpointing=None)  # no checkpointing: the compiled layers keep their graphs
    step = actorcore_step(model, packs, advs, device)
    try:
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(3):  # the first compiles
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
    finally:
        model.zero_grad(set_to_none=True)
        handle.revert()
        gc.collect()
    tokens, seconds = sum(s.numel() for s in sequences), min(times[1:])
    return {"pack_tokens": max_tokens, "packs": len(packs), "seconds": seconds, "tokens_per_s": tokens / seconds,
            "mfu": mfu(active, tokens, seconds), "trace": dict(step.trace),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0}


def main() -> None:
    import actorcore as ac
    import actorcore.hf.features.compiled_decoder as compiled_decoder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--packs", default="32768,20480", help="pack sizes of the steps with the setting on")
    parser.add_argument("--bytes-only", action="store_true",
                        help="only the library's setting, only the bytes per token and layer (no steps)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to check the script (--model tiny)
    model_type, shape = MODELS[args.model]
    model = build(model_type, shape, torch.bfloat16 if device == "cuda" else torch.float32, device, args.layers)
    model.train()
    active, layers = active_parameters(model), model.config.num_hidden_layers
    sequences, advantages = batch_sequences(shape["vocab_size"], args.model == "tiny")
    first, first_adv = (p[0] for p in packs_of(sequences, advantages, 32768))
    library_setting, rows = compiled_decoder.recompute_pointwise, []
    settings = ("recompute pointwise",) if args.bytes_only else ("recompute pointwise", "partitioner default")
    for setting in settings:
        torch._dynamo.reset()
        compiled_decoder.compiled_forward.cache_clear()
        on = setting == "recompute pointwise"
        compiled_decoder.recompute_pointwise = library_setting if on else contextlib.nullcontext
        try:
            kept, tokens = forward_bytes(ac, model, first, first_adv, None, device)  # no checkpointing
            full, _ = forward_bytes(ac, model, first, first_adv, "full", device)
            if args.bytes_only:
                row = {"setting": setting, "bytes_per_token_layer": (kept - full) / tokens / layers,
                       "full_bytes_per_token": full / tokens}
                print(f"[row] {json.dumps(row)}", flush=True)
                rows.append(row)
                continue
            sizes = [int(n) for n in args.packs.split(",")] if on else [32768]
            for max_tokens in sizes:
                row = {"setting": setting, "bytes_per_token_layer": (kept - full) / tokens / layers,
                       **step_row(ac, model, sequences, advantages, max_tokens, active, device)}
                print(f"[row] {json.dumps(row)}", flush=True)
                rows.append(row)
        finally:
            compiled_decoder.recompute_pointwise = library_setting
    meta = {"model": args.model, "layers": layers, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_json(args.out, f"activation_bytes_{args.model}.json", {"meta": meta, "rows": rows})
    print(json.dumps(meta))
    for r in rows:
        if "seconds" not in r:
            print(f"{r['setting']:<22} {r['bytes_per_token_layer']:>9.0f} B per token and layer kept, "
                  f"{r['full_bytes_per_token']:>9.0f} B per token with full checkpointing")
            continue
        print(f"{r['setting']:<22} {r['pack_tokens']:>6} {r['bytes_per_token_layer']:>9.0f} B {r['seconds']:7.3f} s "
              f"{r['tokens_per_s']:8.0f} tok/s {100 * r['mfu']:5.1f}% {r['peak_gib']:6.1f} GiB")


if __name__ == "__main__":
    main()
