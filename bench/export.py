"""Colocated weight sync: an FSDP2 model's weights to a receiving process on the same GPU, over CUDA IPC.

Two ways, same channel (a ``multiprocessing`` pipe carrying JSON), same receiver (a model of the same shape in
another process, loaded with ``load_into``):

- ``bucketed``: ``ipc_send(hf_weight_stream(model))``: buckets packed into two flat CUDA IPC buffers shared once,
  double-buffered (the sender gathers and packs bucket k+1 while the receiver loads bucket k);
- ``naive``: the per-tensor loop verl uses: for each tensor ``full_tensor()``, share it by its own CUDA IPC handle,
  wait until the receiver has opened it and copied it, next tensor.

Per way: seconds (best and median of ``--repeats``), GB/s of payload, the extra peak memory of the sender's and the
receiver's CUDA allocators during the sync (IPC-mapped buffers are the sender's allocations: the receiver's
number is what it allocates itself), and whether every received tensor is bitwise the sender's (a position-
weighted integer checksum per tensor, on both sides). Random weights of a Qwen3-8B-shaped (bf16) and a
Qwen3-30B-A3B-shaped model built on the GPU (``--layers`` to fit). ``--nproc 2`` runs FSDP2 over 2 GPUs (torchrun;
every rank gathers, rank 0 sends to a receiver on GPU 0). ``--tiny``: tiny models on the CPU over shared memory
(checks the script; numbers mean nothing).

    PYTHONPATH=src python3 bench/export.py --model qwen3-8b --out $OUT/export
    PYTHONPATH=src python3 bench/export.py --model qwen3-30b-a3b --layers 40 --out $OUT/export30b
    PYTHONPATH=src python3 bench/export.py --model qwen3-8b --nproc 2 --buffers 1 --out $OUT/export2
    PYTHONPATH=src python3 bench/export.py --tiny --out /tmp/export-tiny
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, tie_word_embeddings=False)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, decoder_sparse_step=1,
                     mlp_only_layers=[], max_position_embeddings=40960, tie_word_embeddings=False)
TINY_DENSE = dict(QWEN3_8B, vocab_size=331, hidden_size=64, intermediate_size=88, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_MOE = dict(QWEN3_30B_A3B, vocab_size=331, hidden_size=64, intermediate_size=88, moe_intermediate_size=40,
                num_experts=4, num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
MODELS = {"qwen3-8b": (QWEN3_8B, TINY_DENSE, 36), "qwen3-30b-a3b": (QWEN3_30B_A3B, TINY_MOE, 40)}
METHODS = ("bucketed", "naive")


def _config(shape: dict, layers: int):
    from transformers import AutoConfig

    fields = dict(shape, num_hidden_layers=layers)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _checksum(tensor: torch.Tensor) -> list[int]:
    """Two integer sums of the tensor's bytes as words (plain and position-weighted): equal iff bitwise equal,
    with overwhelming probability; exact integer arithmetic, so the same on both sides whatever the order."""
    flat = tensor.detach().contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes % 4 == 0 and nbytes and flat.storage_offset() * flat.element_size() % 4 == 0:
        words = flat.view(torch.int32)
    else:
        words = flat.clone().view(torch.uint8).to(torch.int32)
    plain = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    chunk = 1 << 26
    for start in range(0, words.numel(), chunk):
        part = words[start:start + chunk].to(torch.int64)
        plain += part.sum()
        weight = torch.arange(start, start + part.numel(), device=flat.device, dtype=torch.int64) % 1_000_003 + 1
        weighted += (part * weight).sum()
    return [int(plain), int(weighted)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _extra_peak(device: torch.device, base: int) -> int:
    return torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0


# ---------------------------------------------------------------------------------------------------- naive loop
def _naive_send(model, conn, device: torch.device, send: bool) -> None:
    """verl's loop: per tensor full_tensor(), its own IPC handle (or a fresh shared-memory copy on the CPU), wait
    for the receiver's answer before the next. Non-sending ranks only take part in the gathers."""
    from torch.distributed.tensor import DTensor

    from actorcore.export.ipc_buffers import SendBuffer

    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
        if not send:
            continue
        if device.type == "cuda":
            storage = full.untyped_storage()
            (dev, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync) = storage._share_cuda_()
            where = dict(kind="cuda", device=int(dev), handle=bytes(handle).hex(), size=int(size),
                         offset=int(offset), ref_handle=bytes(ref_handle).hex(), ref_offset=int(ref_offset),
                         event_handle=bytes(event_handle).hex(), event_sync=bool(event_sync),
                         storage_offset=full.storage_offset(), stride=list(full.stride()))
            keep = None
        else:
            keep = SendBuffer("shm", max(full.numel() * full.element_size(), 64), device)
            keep.tensor[:full.numel() * full.element_size()].view(full.dtype).view(full.shape).copy_(full)
            where = dict(keep.description, storage_offset=0, stride=None)
        conn.send_bytes(json.dumps(dict(name=name, dtype=str(full.dtype).removeprefix("torch."),
                                        shape=list(full.shape), where=where)).encode())
        answer = json.loads(conn.recv_bytes())
        if answer != {"ok": name}:
            raise RuntimeError(f"naive receiver answered {answer} for {name}")
        if keep is not None:
            keep.release()
        del full
    if send:
        conn.send_bytes(json.dumps(dict(name=None)).encode())


def _naive_receive(model, conn) -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from actorcore.export.ipc import DTYPES
    from actorcore.export.ipc_buffers import ReceiveBuffer

    targets = model.state_dict()
    with torch.no_grad():
        while True:
            message = json.loads(conn.recv_bytes())
            name = message["name"]
            if name is None:
                return
            dtype, shape, where = DTYPES[message["dtype"]], message["shape"], message["where"]
            if where["kind"] == "cuda":
                tensor = rebuild_cuda_tensor(
                    torch.Tensor, torch.Size(shape), tuple(where["stride"]), where["storage_offset"],
                    torch.UntypedStorage, dtype, where["device"], bytes.fromhex(where["handle"]), where["size"],
                    where["offset"], False, bytes.fromhex(where["ref_handle"]), where["ref_offset"],
                    bytes.fromhex(where["event_handle"]), where["event_sync"])
                targets[name].copy_(tensor)
                torch.cuda.current_stream().synchronize()
            else:
                buffer = ReceiveBuffer(dict(kind="shm", nbytes=where["nbytes"], name=where["name"]))
                nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                tensor = buffer.tensor[:nbytes].view(dtype).view(shape)
                targets[name].copy_(tensor)
            del tensor  # the mapping goes with it: the sender may free the tensor
            conn.send_bytes(json.dumps({"ok": name}).encode())


# ------------------------------------------------------------------------------------------------- receiver side
def _receiver_main(conn, jobs: list[tuple[dict, int, list[str]]], device_name: str) -> None:
    """The colocated engine: per job a model of the same shape (uninitialised memory), loaded by each run of its
    plan; the runs' times, peaks and checksums go back after each job."""
    from transformers import AutoModelForCausalLM

    from actorcore.export import ipc_receive, load_into

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    for shape, layers, plan in jobs:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_config(shape, layers), dtype=torch.bfloat16)
        model = model.to_empty(device=device).eval()
        runs = []
        for method in plan:
            conn.send_bytes(b'"idle"')  # the sender starts its clock only after this: checksums are not timed
            base = _reset_peak(device)
            start = time.perf_counter()
            if method.endswith("bucketed"):
                with ipc_receive(conn) as stream:
                    load_into(model, stream)
            else:
                _naive_receive(model, conn)
            _sync(device)
            runs.append(dict(method=method, seconds=time.perf_counter() - start,
                             extra_peak=_extra_peak(device, base)))
            runs[-1]["checksums"] = {n: _checksum(t) for n, t in model.state_dict().items()}
            with torch.no_grad():  # the next run must write every byte again
                for tensor in model.state_dict().values():
                    tensor.fill_(0)
        conn.send_bytes(json.dumps(runs).encode())
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------- sender side
def _build_sender_model(shape: dict, layers: int, device: torch.device, mesh):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(_config(shape, layers), dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sender_checksums(model, rank: int) -> dict[str, list[int]]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0:
            out[name] = _checksum(full)
        del full
    return out


def _job(key: str, args) -> tuple[dict, int, list[str]]:
    real, tiny, default_layers = MODELS[key]
    shape = tiny if args.tiny else real
    layers = args.layers or (shape["num_hidden_layers"] if args.tiny else default_layers)
    # one untimed warm-up run per method first: CUDA contexts, IPC mappings, allocator segments, lazy imports
    return shape, layers, [*(f"warmup-{m}" for m in args.methods), *(m for m in args.methods
                                                                     for _ in range(args.repeats))]


def _run_model(key: str, args, device: torch.device, mesh, rank: int, conn) -> list[dict]:
    import torch.distributed as dist

    from actorcore.export import hf_weight_stream, ipc_send

    shape, layers, plan = _job(key, args)
    model = _build_sender_model(shape, layers, device, mesh)
    payload = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    tensors = len(model.state_dict())
    bucket_bytes = int(args.bucket_mb * 2**20)
    gather_bytes = int(args.gather_mb * 2**20) if args.gather_mb else bucket_bytes
    runs = []
    for method in plan:
        if rank == 0 and json.loads(conn.recv_bytes()) != "idle":
            raise RuntimeError("the receiving process is out of step")
        dist.barrier()
        base = _reset_peak(device)
        start = time.perf_counter()
        stats = None
        if method.endswith("bucketed"):
            stream = hf_weight_stream(model, bucket_bytes=gather_bytes, names="model")
            if rank == 0:
                stats = ipc_send(stream, conn, buffer_bytes=bucket_bytes, buffers=args.buffers, timeout=600)
            else:
                for _ in stream:
                    pass
        else:
            _naive_send(model, conn, device, send=rank == 0)
        _sync(device)
        seconds = time.perf_counter() - start
        runs.append(dict(method=method, seconds=seconds, extra_peak=_extra_peak(device, base),
                         buffers=stats.buckets if stats else None, buffer_bytes=stats.buffer_bytes if stats else None,
                         overlapped=stats.overlapped if stats else None))
    want = _sender_checksums(model, rank)
    rows = []
    if rank == 0:
        received = json.loads(conn.recv_bytes())
        for method in args.methods:
            mine = [r for r in runs if r["method"] == method]
            theirs = [r for r in received if r["method"] == method]
            times = [r["seconds"] for r in mine]
            equal = all(r["checksums"] == want for r in received if r["method"].endswith(method))  # warm-ups too
            rows.append(dict(
                model=key, layers=layers, nproc=dist.get_world_size(), device=str(device), method=method,
                tensors=tensors, payload_gb=payload / 1e9, seconds_best=min(times),
                seconds_median=statistics.median(times), gb_per_s=payload / 1e9 / min(times),
                sender_extra_peak_gib=max(r["extra_peak"] for r in mine) / 2**30,
                receiver_extra_peak_gib=max(r["extra_peak"] for r in theirs) / 2**30,
                bucket_gib=bucket_bytes / 2**30, ipc_buffers=args.buffers,
                buffer_gib=(mine[0]["buffer_bytes"] or 0) / 2**30,
                buffers_sent=mine[0]["buffers"], overlapped=mine[0]["overlapped"], bitwise_equal=equal,
                runs=times))
        naive = next((r for r in rows if r["method"] == "naive"), None)
        for row in rows:
            row["speedup_vs_naive"] = naive["seconds_best"] / row["seconds_best"] if naive else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _write(rows: list[dict], out_dir: str, args) -> None:
    os.makedirs(out_dir, exist_ok=True)
    header = ("| model | layers | GPUs | method | IPC buffers | payload GB | s (best) | s (median) | GB/s | vs naive | "
              "sender extra peak GiB | receiver extra peak GiB | buffer GiB | bitwise |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        speedup = f"{r['speedup_vs_naive']:.1f}x" if r["speedup_vs_naive"] else "-"
        lines.append(f"| {r['model']} | {r['layers']} | {r['nproc']} | {r['method']} | "
                     f"{r['ipc_buffers'] if r['method'] == 'bucketed' else '-'} | {r['payload_gb']:.2f} | "
                     f"{r['seconds_best']:.3f} | {r['seconds_median']:.3f} | {r['gb_per_s']:.1f} | {speedup} | "
                     f"{r['sender_extra_peak_gib']:.2f} | {r['receiver_extra_peak_gib']:.2f} | "
                     f"{r['buffer_gib']:.2f} | {r['bitwise_equal']} |")
    lines.append("")
    for r in rows:
        if r["method"] != "bucketed":
            continue
        buffers = r["sender_extra_peak_gib"] / r["buffer_gib"] if r["buffer_gib"] else float("nan")
        # the goal's unit is a bucket: one IPC buffer (the stream's gathered bucket is at most one too)
        lines.append(f"Goal, {r['model']} on {r['nproc']} GPU(s): {r['seconds_best']:.3f} s (goal <= 0.5 s for 8B), "
                     f"{r['speedup_vs_naive'] or float('nan'):.1f}x the per-tensor loop (goal >= 5x), sender extra "
                     f"peak {buffers:.2f} buffers (goal <= 2), received bitwise equal: {r['bitwise_equal']}.")
    lines.append("")
    lines.append(f"Command: `{' '.join(sys.argv)}`; device: "
                 f"{torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else 'cpu'}; "
                 f"torch {torch.__version__}.")
    for name, text in (("export.json", json.dumps(rows, indent=2)), ("export.md", "\n".join(lines) + "\n")):
        tmp = os.path.join(out_dir, f".{name}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out_dir, name))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 36 for 8B, 40 for 30B)")
    parser.add_argument("--nproc", type=int, default=1, choices=[1, 2], help="FSDP2 ranks (2: relaunch by torchrun)")
    parser.add_argument("--bucket-mb", type=float, default=1280, help="each of the two IPC buffers (MiB)")
    parser.add_argument("--gather-mb", type=float, default=None,
                        help="hf_weight_stream's bucket (MiB; default: --bucket-mb); smaller bounds the gathered "
                             "bucket held beside the two buffers on 2 GPUs")
    parser.add_argument("--buffers", type=int, default=2, choices=[1, 2],
                        help="ipc_send's buffers: 2 overlaps packing with the receiver's load; 1 keeps a sharded "
                             "model's extra memory at one buffer plus one gathered bucket")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU over shared memory")
    parser.add_argument("--out", required=True, help="directory for export.json and export.md")
    args = parser.parse_args()
    if args.tiny:
        args.bucket_mb = min(args.bucket_mb, 0.05)
    if args.nproc == 2 and "LOCAL_RANK" not in os.environ:
        forwarded = [a for k, a in enumerate(sys.argv) if a != "--nproc" and sys.argv[k - 1] != "--nproc"
                     and not a.startswith("--nproc=")]  # under torchrun, WORLD_SIZE says it
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *forwarded]
        raise SystemExit(subprocess.call(cmd))

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    use_cuda = torch.cuda.is_available() and not args.tiny
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if "LOCAL_RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    else:
        with tempfile.NamedTemporaryFile(prefix="actorcore-bench-rdzv-") as f:
            dist.init_process_group(backend, init_method=f"file://{f.name}", rank=0, world_size=1,
                                    device_id=device if use_cuda else None)
    mesh = init_device_mesh(device.type, (world,))
    keys = list(MODELS) if args.model == "both" else [args.model]
    conn = process = None
    if rank == 0:  # one receiving process on the sender's GPU for every model
        ctx = multiprocessing.get_context("spawn")
        conn, there = ctx.Pipe()
        process = ctx.Process(target=_receiver_main, args=(there, [_job(k, args) for k in keys], str(device)))
        process.start()
        there.close()
    rows = []
    try:
        for key in keys:
            rows += _run_model(key, args, device, mesh, rank, conn)
        if rank == 0:
            process.join(600)
            _write(rows, args.out, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
