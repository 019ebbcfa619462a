"""The Megatron route at TP=2, PP=2, CP=2 and EP=2 against the HF route with FSDP2, on the same two GPUs and weights.

Launched with ``torchrun --nproc-per-node 2`` (NCCL on 2 GPUs; ``--tiny``: gloo on the CPU, a tiny fp32 model, to
check the script). Rank 0 writes a randomly initialised Qwen3-8B-shaped checkpoint (``--model qwen3-30b-a3b``: the
Qwen3-30B-A3B MoE shape; ``--layers`` decoder layers, bf16) to a scratch directory; every layout loads those weights:

- ``tp2`` / ``pp2`` / ``cp2`` / ``ep2``: one ``initialize_megatron`` each (destroyed before the next), the whole RL batch
  split into ``--micro-batches`` packed micro-batches (padded to one token count, which pipeline parallelism
  needs), ``actorcore.mcore.compute_logprobs`` forward-only and forward+backward of sum(log-probs);
- ``fsdp2``: ``transformers`` model, ``fully_shard`` per decoder layer and on the whole model, each rank runs
  ``ac.compute_logprobs`` on its half of the micro-batches (micro-batch i on rank i % 2).

Reported per layout and mode: median seconds, tokens/s (real tokens; FSDP2: each rank's tokens over its own time,
summed over ranks; Megatron: the batch's real tokens over the step time, so the padding pipeline parallelism needs
counts against it), peak GiB allocated per rank (weights included), and max |Δ log-prob| against the FSDP2 HF route
on every real token, for the log-probs of each mode (gathered to every rank; rank 0 writes them). bf16 routes use different attention and GEMM kernels: small differences
are expected, a wrong weight or mask gives differences of order 1 or more.

The Megatron layouts build with the route's speed options (``build_gpt_model``'s ``moe_experts``, ``compiled_layers``,
``recompute`` / ``memory_budget_gib``: ``--mcore-experts``, ``--mcore-fused``, ``--mcore-recompute``,
``--budget-gib``; by default the route's defaults and no recompute).

``--convert``: also time ``actorcore convert hf-to-mcore`` and ``mcore-to-hf`` (subprocesses, as the CLI runs) of a
random ``--convert-layers`` checkpoint written by rank 0, against ``shutil.copytree`` of the same directory.

    torchrun --nproc-per-node 2 bench/mcore.py [--model qwen3-8b|qwen3-30b-a3b] [--layers 4 --sequences 32
        --min-len 128 --max-len 4096 --seed 1] [--layouts tp2,pp2,cp2,ep2,fsdp2] [--micro-batches 4]
        [--mcore-experts auto|grouped|quack|sequential] [--mcore-fused auto|on|off]
        [--mcore-recompute none|full|selective|auto --budget-gib 40] [--convert --convert-layers 8 | --no-routes]
        [--out DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
                tie_word_embeddings=False, rms_norm_eps=1e-6)
QWEN3_30B_A3B = dict(QWEN3_8B, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, num_key_value_heads=4)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=4096, rope_theta=5e4, tie_word_embeddings=False, rms_norm_eps=1e-5)
TINY_MOE = dict(TINY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
MODELS = {"qwen3-8b": ("qwen3", QWEN3_8B, TINY), "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B, TINY_MOE)}
MCORE_LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "cp2": dict(cp=2), "ep2": dict(ep=2)}
# torchrun's variables: a conversion subprocess must not think it is a rank of this job.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def _cuda(args) -> bool:
    return torch.cuda.is_available() and not args.tiny


def _sync(args) -> None:
    if _cuda(args):
        torch.cuda.synchronize()


def _measure(fn, args, before=None) -> tuple[float, float, object]:
    """(median seconds, peak GiB allocated on this rank's GPU, last result), after one warm-up call."""
    if before is not None:
        before()
    fn()
    _sync(args)
    if _cuda(args):
        torch.cuda.reset_peak_memory_stats()
    times, result = [], None
    for _ in range(args.repeats):
        if before is not None:
            before()
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        _sync(args)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if _cuda(args) else 0.0
    return sorted(times)[len(times) // 2], peak, result


def _per_rank(values: list[float], args) -> list[list[float]]:
    """Every rank's ``values``, as a list over ranks (an all-reduce of a zero-filled table)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    table = torch.zeros(world, len(values), dtype=torch.float64, device="cuda" if _cuda(args) else "cpu")
    table[rank] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(table)
    return table.tolist()


def _micro_batches(args, vocab: int):
    """The RL batch: ``--sequences`` random lengths in [min, max] (seed ``--seed``), in contiguous micro-batches."""
    import actorcore as ac

    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.sequences,), generator=gen).tolist()
    sequences = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    per = -(-len(sequences) // args.micro_batches)
    return [ac.pack(sequences[i : i + per]) for i in range(0, len(sequences), per)]


def _write_checkpoint(args, layers: int, directory: str) -> float:
    """Rank 0: a random checkpoint of ``--model``'s shape (safetensors) in ``directory``; returns its size in GB."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(MODELS[args.model][0], **_shape(args), num_hidden_layers=layers)
    torch.manual_seed(0)
    with torch.device("cuda" if _cuda(args) else "cpu"):
        model = AutoModelForCausalLM.from_config(config).to(torch.float32 if args.tiny else torch.bfloat16)
    model.save_pretrained(directory)
    del model
    if _cuda(args):
        torch.cuda.empty_cache()
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 1e9


def _shape(args) -> dict:
    _, shape, tiny = MODELS[args.model]
    return tiny if args.tiny else shape


def _speed_options(args) -> dict:
    """``build_gpt_model``'s speed options from the ``--mcore-*`` flags."""
    recompute = None if args.mcore_recompute == "none" else args.mcore_recompute
    return dict(moe_experts=args.mcore_experts, compiled_layers={"auto": "auto", "on": True, "off": False}[args.mcore_fused],
                recompute=recompute, memory_budget_gib=args.budget_gib if recompute == "auto" else None)


def _real(log_probs: list[torch.Tensor], batches) -> torch.Tensor:
    """Concatenated log-probs of the real tokens (padding dropped), float32 on the CPU."""
    return torch.cat([lp[: b.num_real_tokens].float().cpu() for lp, b in zip(log_probs, batches)])


def _mcore_layout(name: str, hf_dir: str, batches, args) -> tuple[dict, torch.Tensor]:
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from actorcore.batch import pad_to_multiple
    from actorcore.mcore import McoreParallel, build_gpt_model, initialize_megatron, load_hf_into_mcore
    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore.run.forward import compute_logprobs

    # One token count for every micro-batch (pipeline P2P shapes are fixed), a multiple of 8 for TP / CP.
    target = -(-max(b.num_tokens for b in batches) // 8) * 8
    padded = [pad_to_multiple(b, target) if b.num_tokens < target else b for b in batches]
    with CpuRuntime():  # no-op with CUDA
        parallel = McoreParallel(**MCORE_LAYOUTS[name])
        initialize_megatron(parallel)
        mcore_model = build_gpt_model(AutoConfig.from_pretrained(hf_dir), parallel, **_speed_options(args))
        chunks = mcore_model.chunks
        load_hf_into_mcore(mcore_model, hf_dir)
        params = [p for chunk in chunks for p in chunk.parameters()]

        def zero_grad():
            for p in params:
                p.grad = None
            if hasattr(params[0], "main_grad"):
                for p in params:
                    p.main_grad = None

        def forward():
            with torch.no_grad():
                return [o.log_probs for o in compute_logprobs(mcore_model, padded, entropy=False)]

        def forward_backward():
            return [o.log_probs for o in compute_logprobs(mcore_model, padded, entropy=False,
                                                          loss_fn=lambda out, b: -out.log_probs.sum())]

        fwd = _measure(forward, args)
        fb = _measure(forward_backward, args, before=zero_grad)
        zero_grad()
        del mcore_model, chunks, params
        ps.destroy_model_parallel()
    if _cuda(args):
        torch.cuda.empty_cache()
    tokens = sum(b.num_real_tokens for b in batches)
    row = {"layout": name, "tokens": tokens, "options": {k: str(v) for k, v in _speed_options(args).items()}}
    for mode, (seconds, peak, _) in (("forward", fwd), ("forward_backward", fb)):
        peaks = [r[0] if _cuda(args) else None for r in _per_rank([peak], args)]
        row.update({f"{mode}_s": seconds, f"{mode}_tokens_per_s": tokens / seconds,
                    f"{mode}_peak_gib_per_rank": peaks})
    return row, {"forward": _real(fwd[2], batches), "forward_backward": _real(fb[2], batches)}


def _fsdp2(hf_dir: str, batches, args) -> tuple[dict, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import actorcore as ac

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if _cuda(args) else torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", device_map=None,
                                                 dtype=torch.float32 if args.tiny else torch.bfloat16).to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    mine = [i for i in range(len(batches)) if i % world == rank]
    own = [batches[i].to(device) for i in mine]

    def forward():
        model.eval()
        with torch.no_grad():
            return [ac.compute_logprobs(model, b, entropy=False).log_probs for b in own]

    def forward_backward():
        model.train()
        outs = []
        for b in own:
            out = ac.compute_logprobs(model, b, entropy=False)
            (-out.log_probs.sum()).backward()
            outs.append(out.log_probs.detach())
        return outs

    fwd = _measure(forward, args)
    fb = _measure(forward_backward, args, before=lambda: model.zero_grad(set_to_none=True))
    model.zero_grad(set_to_none=True)
    offsets = [0]
    for b in batches:
        offsets.append(offsets[-1] + b.num_real_tokens)

    def gathered(log_probs: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's log-probs in one [T] vector (zeros elsewhere, summed over ranks), on the CPU."""
        full = torch.zeros(offsets[-1], dtype=torch.float32, device=device)
        for i, lp in zip(mine, log_probs):
            full[offsets[i] : offsets[i + 1]] = lp[: batches[i].num_real_tokens].float()
        dist.all_reduce(full)
        return full.cpu()

    log_probs = {"forward": gathered(fwd[2]), "forward_backward": gathered(fb[2])}
    del model
    if _cuda(args):
        torch.cuda.empty_cache()
    tokens = sum(batches[i].num_real_tokens for i in mine)
    row = {"layout": "fsdp2", "tokens": sum(b.num_real_tokens for b in batches)}
    for mode, (seconds, peak, _) in (("forward", fwd), ("forward_backward", fb)):
        table = _per_rank([tokens, seconds, peak], args)
        row.update({f"{mode}_s": max(r[1] for r in table),
                    f"{mode}_tokens_per_s": sum(r[0] / r[1] for r in table),
                    f"{mode}_peak_gib_per_rank": [r[2] if _cuda(args) else None for r in table]})
    return row, log_probs


def _convert(args, workdir: str) -> dict:
    """Rank 0: time the CLI's two conversions and a plain directory copy of one random checkpoint."""
    src, copy, mcore_dir, back = (os.path.join(workdir, n) for n in ("conv-hf", "conv-copy", "conv-mcore", "conv-back"))
    gigabytes = _write_checkpoint(args, args.convert_layers, src)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                                                    + "/src", env.get("PYTHONPATH", "")] if p)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def cli(*argv):
        subprocess.run([sys.executable, "-m", "actorcore", "convert", *argv], env=env, check=True)

    result = {"checkpoint_gb": gigabytes, "layers": args.convert_layers}
    result["copytree_s"] = timed(lambda: shutil.copytree(src, copy))
    result["hf_to_mcore_s"] = timed(lambda: cli("hf-to-mcore", src, mcore_dir))
    result["mcore_to_hf_s"] = timed(lambda: cli("mcore-to-hf", mcore_dir, back))
    for key in ("copytree", "hf_to_mcore", "mcore_to_hf"):
        result[f"{key}_gb_per_s"] = gigabytes / result[f"{key}_s"]
    for d in (src, copy, mcore_dir, back):
        shutil.rmtree(d, ignore_errors=True)
    return result


def _markdown(result: dict) -> str:
    lines = [f"# bench/mcore.py: {result['model']}, {result['layers']} layers, {result['device']} x2", ""]
    if result.get("routes"):
        lines += [f"Batch: {result['sequences']} sequences, {result['min_len']}-{result['max_len']} tokens "
                  f"(seed {result['seed']}), {result['tokens']} tokens, {result['micro_batches']} micro-batches.", "",
                  "| layout | mode | s | tokens/s | peak GiB allocated per rank | max abs d log-prob vs fsdp2 |",
                  "|---|---|---:|---:|---|---:|"]
        for row in result["routes"]:
            for mode in ("forward", "forward_backward"):
                peaks = ", ".join("n/a" if p is None else f"{p:.2f}" for p in row[f"{mode}_peak_gib_per_rank"])
                delta = row[f"{mode}_max_abs_dlogprob_vs_fsdp2"]
                lines.append(f"| {row['layout']} | {mode.replace('_', '+')} | {row[f'{mode}_s']:.3f} | "
                             f"{row[f'{mode}_tokens_per_s']:.0f} | {peaks} | "
                             f"{'-' if delta is None else f'{delta:.3g}'} |")
        lines.append("")
    if result.get("convert"):
        c = result["convert"]
        lines += [f"Conversion of a {c['checkpoint_gb']:.3g} GB checkpoint ({c['layers']} layers):", "",
                  "| step | s | GB/s |", "|---|---:|---:|"]
        for key, label in (("copytree", "shutil.copytree"), ("hf_to_mcore", "convert hf-to-mcore"),
                           ("mcore_to_hf", "convert mcore-to-hf")):
            lines.append(f"| {label} | {c[f'{key}_s']:.2f} | {c[f'{key}_gb_per_s']:.3g} |")
        lines.append("")
    return "\n".join(lines)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def run(args) -> None:
    rank = dist.get_rank()
    workdir = [tempfile.mkdtemp(prefix="bench-mcore-", dir=args.workdir) if rank == 0 else None]
    dist.broadcast_object_list(workdir, src=0)
    workdir = workdir[0]
    shape = _shape(args)
    result = {"model": f"tiny ({args.model})" if args.tiny else f"{args.model}-shaped", "layers": args.layers,
              "device": torch.cuda.get_device_name(0) if _cuda(args) else "cpu (gloo)",
              "sequences": args.sequences, "min_len": args.min_len, "max_len": args.max_len, "seed": args.seed,
              "micro_batches": args.micro_batches, "routes": [], "convert": None}
    try:
        if not args.no_routes:
            hf_dir = os.path.join(workdir, "hf")
            if rank == 0:
                _write_checkpoint(args, args.layers, hf_dir)
            dist.barrier()
            batches = _micro_batches(args, shape["vocab_size"])
            result["tokens"] = sum(b.num_real_tokens for b in batches)
            log_probs = {}
            for name in args.layouts:
                row, log_probs[name] = (_fsdp2(hf_dir, batches, args) if name == "fsdp2"
                                        else _mcore_layout(name, hf_dir, batches, args))
                result["routes"].append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
            reference = log_probs.get("fsdp2")
            for row in result["routes"]:
                for mode in ("forward", "forward_backward"):
                    row[f"{mode}_max_abs_dlogprob_vs_fsdp2"] = (
                        None if reference is None else
                        float((log_probs[row["layout"]][mode] - reference[mode]).abs().max()))
        if args.convert and rank == 0:
            result["convert"] = _convert(args, workdir)
        dist.barrier()
        if rank == 0:
            text = _markdown(result)
            print(text, flush=True)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                _write(os.path.join(args.out, "mcore.json"), json.dumps(result, indent=2))
                _write(os.path.join(args.out, "mcore.md"), text)
    finally:
        if rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (even, for pp2)")
    parser.add_argument("--mcore-experts", default="auto", choices=("auto", "grouped", "quack", "sequential"))
    parser.add_argument("--mcore-fused", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--mcore-recompute", default="none", choices=("none", "full", "selective", "auto"))
    parser.add_argument("--budget-gib", type=float, default=40.0, help="recompute 'auto''s budget per GPU")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1, help="seed of the batch's lengths and tokens")
    parser.add_argument("--micro-batches", type=int, default=4, help="even: FSDP2 gives each rank half of them")
    parser.add_argument("--layouts", default="fsdp2,tp2,pp2,cp2", help="comma-separated subset, run in this order")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--convert", action="store_true", help="also time the checkpoint conversions")
    parser.add_argument("--convert-layers", type=int, default=8, help="layers of the conversion checkpoint")
    parser.add_argument("--no-routes", action="store_true", help="only the conversion (with --convert)")
    parser.add_argument("--workdir", default=None, help="scratch directory for the checkpoints (default: $TMPDIR)")
    parser.add_argument("--out", default=None, help="directory for mcore.json and mcore.md (rank 0)")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on gloo CPU ranks (checks the script)")
    args = parser.parse_args()
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in args.layouts if name not in (*MCORE_LAYOUTS, "fsdp2")]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {sorted([*MCORE_LAYOUTS, 'fsdp2'])}")
    if args.tiny:
        args.layers, args.sequences, args.min_len, args.max_len, args.repeats = 2, 8, 4, 40, 1
        args.convert_layers = 2
    if args.layers % 2 or args.micro_batches % 2:
        parser.error("--layers and --micro-batches must be even (pp2 splits the layers, fsdp2 the micro-batches)")
    if args.no_routes and not args.convert:
        parser.error("--no-routes without --convert leaves nothing to run")
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) != 2:
        parser.error("launch with torchrun --nproc-per-node 2")
    local_rank = int(os.environ["LOCAL_RANK"])
    if _cuda(args):
        if torch.cuda.device_count() < 2:
            parser.error("needs 2 CUDA devices (or --tiny)")
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
