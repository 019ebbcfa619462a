"""Which allocations are alive at each route's peak: the HF route's and the Megatron route's actor step (the
Qwen3-30B-A3B shape by default, ``MODEL=`` another of ``actor_step.MODELS``; 2 layers, one 32K-token pack, the
third call traced), the CUDA caching allocator's trace replayed to the step's peak and the live bytes grouped by
the innermost actorcore / megatron / transformers frames that allocated them. Why one route peaks higher than the
other, where ``bench/layer_memory.py`` says what each layer keeps.

    PYTHONPATH=src python3 bench/peak_sources.py          # on a GPU; LITE=1: torch's varlen attention and
                                                          # grouped_mm experts (without FA4 and quack)

Off CUDA it runs the same steps (to check the script) and reports no trace.
"""

from __future__ import annotations

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import actor_step  # noqa: E402

import actorcore as ac  # noqa: E402

CUDA = torch.cuda.is_available()
SOURCES = ("actorcore", "megatron", "transformers/models", "bench/")


def live_at_peak(snapshot: dict) -> tuple[int, collections.Counter]:
    """(the traced allocations' peak, live bytes at it per allocating source) from the allocator's event trace."""
    live, total, best, best_live = {}, 0, -1, {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    groups = collections.Counter()
    for event in best_live.values():
        frames = [f for f in event.get("frames", []) if any(k in f["filename"] for k in SOURCES)]
        key = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames[:3]) or "?"
        groups[key] += event["size"]
    return best, groups


def allocated_after(snapshot: dict) -> int:
    """Bytes still allocated when the snapshot was taken, after the traced call (weights and gradients)."""
    return sum(b["size"] for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")


def traced(step, calls: int = 3) -> tuple[int, dict] | None:
    """Run ``step`` ``calls`` times, the last one under the allocator's trace: (max allocated, snapshot)."""
    for i in range(calls):
        if CUDA and i == calls - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=300000)
        step()
    if not CUDA:
        return None
    torch.cuda.synchronize()
    out = (torch.cuda.max_memory_allocated(), torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled=None)
    return out


def main() -> None:
    device = "cuda" if CUDA else "cpu"
    model, pack, pack_advantages = actor_step.one_pack_model(os.environ.get("MODEL", "qwen3-30b-a3b"), device, 2)
    batch, adv = ac.pack(pack).to(device), torch.cat(pack_advantages).to(device)
    lite = os.environ.get("LITE") == "1" or not CUDA
    experts, attention = ("grouped" if CUDA else False, "torch_varlen" if CUDA else "auto") if lite else \
        ("quack", "auto")
    handle = ac.patch_model(model, compiled_decoder="auto", checkpointing=None, moe_experts=experts,
                            swiglu_mlp=False, attention_backend=attention)

    def hf_step():
        model.zero_grad(set_to_none=True)
        ac.compute_loss(model, batch, lambda lp, ent, a: -(lp * a), (adv,), entropy=False).loss.backward()

    results = {"hf": traced(hf_step)}
    handle.revert()
    from actorcore.mcore.build.attention import use_attention_backend

    options = dict(moe_experts=experts or "grouped", compiled_layers=CUDA, swiglu_mlp=False, recompute=None)
    step, chunks = actor_step.megatron_step(model, [pack], [pack_advantages], device, options, fused_loss=True)
    if CUDA and lite:
        use_attention_backend(list(chunks), "torch_varlen")

    def megatron_step():
        chunks.zero_grad()
        step()

    results["megatron"] = traced(megatron_step)
    for name, result in results.items():
        if result is None:
            print(f"{name}: ran, no trace off CUDA")
            continue
        peak, snapshot = result
        best, groups = live_at_peak(snapshot)
        print(f"== {name}: max allocated {peak / 2**30:.3f} GiB, traced allocations' peak {best / 2**30:.3f} GiB, "
              f"allocated after it {allocated_after(snapshot) / 2**30:.3f} GiB")
        for key, size in groups.most_common(14):
            print(f"   {size / 2**20:9.1f} MiB  {key}")


if __name__ == "__main__":
    main()
