"""Context parallelism on the Megatron route: CP=2 against CP=1 (data parallel) on the same two GPUs.

Two NCCL ranks (``--tiny``: two gloo CPU ranks and a tiny model, to check the script), a randomly initialised
Qwen3-8B-shaped model with a few layers, bf16, an RL-like packed batch of sequences of very different lengths.
Each layout runs forward-only log-probs and forward+backward on the same batch and weights (copied from the
CP=1 model): CP=1 gives each GPU the whole batch (two batches per step over the two GPUs), CP=2 splits it over
both. CP=2 runs with each requested key/value exchange (``--cp-comm``: Megatron's ``cp_comm_type``
``all_gather``, one all-gather per layer, or ``p2p``, the ring that passes one rank's block at a time and merges
partial softmaxes; ``both`` runs them side by side). Reported per layout: median seconds, tokens/s over both
GPUs, peak memory per GPU, the attention kernels that ran (``attention_paths``, trace keys), and max |Δ log-prob|
of CP=2 against CP=1 (bf16 model: attention kernels differ, so small differences are expected) and, with
``both``, of the ring against the all-gather.

    PYTHONPATH=src python3 bench/mcore_cp.py [--layers 4 --sequences 16 --min-len 512 --max-len 8192]
        [--cp-comm all_gather|p2p|both] [--out results.json] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter

import torch

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                tie_word_embeddings=False, rms_norm_eps=1e-6)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _measure(fn, repeats: int) -> tuple[float, float, object]:
    """(median seconds, peak GiB allocated on this GPU, last result)."""
    fn()  # warm-up
    _sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        _sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return sorted(times)[len(times) // 2], peak, result


def _batch(args: argparse.Namespace, vocab: int):
    import actorcore as ac

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.sequences,), generator=gen).tolist()
    return ac.pack([torch.randint(0, vocab, (n,), generator=gen) for n in lengths])


def _layout(cp: int, hf_config, batch, args, state: dict | None,
            cp_comm: str | None = None) -> tuple[dict, dict, torch.Tensor]:
    from megatron.core import parallel_state as ps

    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron

    parallel = McoreParallel(cp=cp)
    initialize_megatron(parallel)
    overrides = {} if cp_comm is None else {"cp_comm_type": cp_comm}
    mcore_model = build_gpt_model(hf_config, parallel, dtype=torch.float32 if args.tiny else torch.bfloat16,
                                  **overrides)
    chunks = mcore_model.chunks
    if state is None:  # random initialisation may differ between ranks: every rank takes rank 0's weights
        from actorcore.parallel import collectives

        for tensor in chunks[0].state_dict().values():
            if isinstance(tensor, torch.Tensor):
                collectives.broadcast_tensor(tensor, 0, torch.distributed.group.WORLD)
    else:
        chunks[0].load_state_dict(state)
    own_state = chunks[0].state_dict()
    trace: Counter = Counter()  # which attention kernels ran (the flash paths on the GPU)
    for layer in chunks[0].decoder.layers:
        layer.self_attention.core_attention.trace = trace

    def forward():
        with torch.no_grad():
            return compute_logprobs(mcore_model, batch, entropy=False).log_probs

    def forward_backward():
        for p in chunks[0].parameters():
            p.grad = None
        return compute_logprobs(mcore_model, batch, entropy=False,
                                loss_fn=lambda out, b: -out.log_probs.sum() / b.num_tokens).log_probs

    fwd_s, fwd_peak, log_probs = _measure(forward, args.repeats)
    fb_s, fb_peak, _ = _measure(forward_backward, args.repeats)
    batches_per_step = 2 // cp  # CP=1: each GPU runs the whole batch (data parallel)
    row = {"cp": cp, "cp_comm_type": cp_comm, "tokens": batch.num_tokens, "forward_s": fwd_s,
           "forward_backward_s": fb_s,
           "forward_tokens_per_s": batch.num_tokens * batches_per_step / fwd_s,
           "forward_backward_tokens_per_s": batch.num_tokens * batches_per_step / fb_s,
           "forward_peak_gib": fwd_peak, "forward_backward_peak_gib": fb_peak,
           "attention_paths": sorted(trace)}
    del mcore_model, chunks
    ps.destroy_model_parallel()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, own_state, log_probs


def _rank(rank: int, world_size: int, args: argparse.Namespace, directory: str) -> None:
    import torch.distributed as dist
    from transformers import Qwen3Config

    from actorcore.mcore.cpu_runtime import CpuRuntime

    if torch.cuda.is_available() and not args.tiny:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{directory}/rendezvous", rank=rank,
                                world_size=world_size, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank,
                                world_size=world_size)
    shape = TINY if args.tiny else QWEN3_8B
    hf_config = Qwen3Config(**shape, num_hidden_layers=args.layers)
    batch = _batch(args, shape["vocab_size"])
    try:
        with CpuRuntime():
            cp1, state, lp1 = _layout(1, hf_config, batch, args, None)
            comms = ["all_gather", "p2p"] if args.cp_comm == "both" else [args.cp_comm]
            rows, log_probs = {}, {}
            for comm in comms:
                rows[comm], _, log_probs[comm] = _layout(2, hf_config, batch, args, state, comm)
                rows[comm]["max_abs_dlogprob_vs_cp1"] = float((log_probs[comm].float() - lp1.float()).abs().max())
        if len(comms) == 2:
            rows["p2p"]["max_abs_dlogprob_vs_all_gather"] = float(
                (log_probs["p2p"].float() - log_probs["all_gather"].float()).abs().max())
        if rank == 0:
            result = {"model": "tiny" if args.tiny else "qwen3-8b-shaped", "layers": args.layers,
                      "sequences": args.sequences, "device": torch.cuda.get_device_name(0)
                      if torch.cuda.is_available() and not args.tiny else "cpu", "cp1_dp2": cp1,
                      **{f"cp2_{comm}": row for comm, row in rows.items()}}
            text = json.dumps(result, indent=2)
            print(text)
            if args.out:
                tmp = f"{args.out}.tmp-{os.getpid()}"
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, args.out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cp-comm", choices=["all_gather", "p2p", "both"], default="both",
                        help="CP=2's key/value exchange (Megatron's cp_comm_type); both: side by side")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on two gloo CPU ranks (checks the script)")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.sequences, args.min_len, args.max_len, args.repeats = 2, 4, 1, 40, 1
    elif torch.cuda.device_count() < 2:
        parser.error("needs 2 CUDA devices (or --tiny)")
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.spawn(_rank, args=(2, args, directory), nprocs=2, join=True)


if __name__ == "__main__":
    main()
