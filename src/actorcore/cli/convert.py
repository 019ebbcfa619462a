"""``actorcore convert``: HF <-> Megatron-Core checkpoints (part of the CLI: it prints).

  actorcore convert hf-to-mcore SRC_HF_DIR DST_DIR [--tp N --pp N --ep N] [--mtp]
  actorcore convert mcore-to-hf SRC_MCORE_DIR DST_HF_DIR [--max-shard-size BYTES] [--mxfp4]

hf-to-mcore writes a Megatron distributed checkpoint (loadable at any layout); with a layout bigger than
one rank it runs one gloo process per rank (CPU). mcore-to-hf loads in one process and writes sharded
safetensors (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``) + config, streamed
bucket by bucket (``mcore_weight_stream`` into ``export.save_sharded_safetensors``). Output goes to a temporary
directory next to DST, renamed at the end: a failure leaves nothing behind. Damaged or incomplete input, a full
disk and flags the model cannot take are a one-line error and exit code 2. SIGINT / SIGTERM stop the run (ranks
included) and clean up (``actorcore.cli.processes``); dtypes come from the tensors, never from config.json.
On machines without CUDA megatron-core runs inside ``actorcore.mcore.cpu_runtime.CpuRuntime`` (its CPU shims,
applied for the run and restored after).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
import tempfile
import traceback
from typing import Any, Iterator

from actorcore.cli.errors import EXIT_USER_ERROR, OneLineParser, first_line, is_user_error
from actorcore.cli.output_dir import atomic_output, disk_full, nearly_full
from actorcore.cli.processes import run_ranks
from actorcore.lifecycle import Interrupted, SignalGuard
from actorcore.mcore.convert import fault_points
from actorcore.parallel.spawn import free_port
from actorcore.sizes import positive_size



def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="actorcore convert", description="HF <-> Megatron-Core checkpoints. Exit 0 OK, 2 bad "
                                                                 "input, 128+N on signal N.")
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors directory -> Megatron distributed checkpoint")
    to_mcore.add_argument("src", help="HF model directory (config.json + safetensors)")
    to_mcore.add_argument("dst", help="output directory (must not exist)")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size used for the conversion")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    to_mcore.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE)")
    to_mcore.add_argument("--mtp", action="store_true",
                          help="keep the multi-token-prediction layers (DeepSeek-V3's model.layers.{num_hidden_layers}"
                               ".*, Qwen3-Next's / Qwen3.5's mtp.*); without it they are dropped (logged)")
    to_mcore.add_argument("--vocab-multiple", type=int, default=128,
                          help="pad the vocabulary to a multiple of this (must be divisible by every TP size used)")
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF safetensors + config")
    to_hf.add_argument("src", help="directory written by hf-to-mcore")
    to_hf.add_argument("dst", help="output directory (must not exist)")
    to_hf.add_argument("--max-shard-size", type=int, default=5 * 1024**3,
                       help="bytes per safetensors shard (a larger tensor gets a shard of its own)")
    to_hf.add_argument("--mxfp4", action="store_true",
                       help="write the fused experts as MXFP4 blocks + scales, as the gpt-oss releases store them "
                            "(default: bf16)")
    return parser


@contextlib.contextmanager
def _megatron_runtime(rank: int, world_size: int, port: int) -> Iterator[None]:
    """A gloo world (created here if none exists) and, without CUDA, megatron-core's CPU runtime; what was
    set up here (the world, Megatron's parallel state, the CPU shims) is undone after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from actorcore.mcore.cpu_runtime import CpuRuntime

    created = not dist.is_initialized()
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    megatron_was_initialized = parallel_state.model_parallel_is_initialized()
    try:
        with CpuRuntime():  # does nothing on a machine with CUDA
            yield
    finally:
        if not megatron_was_initialized and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _hf_to_mcore_rank(rank: int, world_size: int, port: int, src: str, out: str, sizes: tuple[int, int, int],
                      vocab_multiple: int, mtp: bool = False) -> None:
    from actorcore.mcore.convert.dist_checkpoint import save_mcore_checkpoint
    from actorcore.mcore.convert.load import checkpoint_expert_layout, load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model, mcore_spec_for
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.safetensors_reader import safetensors_dtype

    hf_config = _read_hf_config(src)
    # The tensors' own dtype, whatever config.json declares: no re-typing (the router's float32 expert bias aside).
    dtype = safetensors_dtype(src, mcore_spec_for(hf_config))
    tp, pp, ep = sizes
    parallel = McoreParallel(tp=tp, pp=pp, ep=ep)
    with _megatron_runtime(rank, world_size, port):
        initialize_megatron(parallel)
        # No random initialisation: the load fills (and checks) every parameter; initialising an 8B-shaped model
        # on the CPU took most of a conversion's time (measured: 27 of 42 s for a 3.1 GB checkpoint).
        model = build_gpt_model(hf_config, parallel, dtype, vocab_multiple=vocab_multiple, mtp=mtp,
                                expert_layout=checkpoint_expert_layout(src, hf_config), perform_initialization=False)
        fault_points.reach("loading")
        load_hf_into_mcore(model, src, progress=rank == 0)
        save_mcore_checkpoint(model, out, src)


def _read_hf_config(src: str) -> Any:
    from transformers import AutoConfig

    from actorcore.errors import CheckpointError

    try:
        return AutoConfig.from_pretrained(src)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{src}: cannot read the HF config ({first_line(exc)})") from None


def _spawned_rank(rank: int, world_size: int, port: int, error_dir: str, args: tuple) -> None:
    try:
        _hf_to_mcore_rank(rank, world_size, port, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
        message = _user_message(exc)
        if message is None and nearly_full(os.path.dirname(args[1])):
            message = _user_message(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        with open(os.path.join(error_dir, f"rank{rank}"), "w") as f:
            f.write(f"user:{message}" if message else f"bug:{traceback.format_exc()}")
        raise SystemExit(1) from None


def _user_message(exc: BaseException) -> str | None:
    """The one line to show for an error the user can act on; None for a bug (shown with its traceback)."""
    if disk_full(exc):
        return "no space left on the device of the output directory: free some space or choose another DST"
    if is_user_error(exc):
        return first_line(exc)
    return None


def _check_source_dir(src: str, what: str) -> None:
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{src}: no such directory; give the path of {what}")


def _check_layout(args: argparse.Namespace, hf_config: Any) -> None:
    """Refuse sizes the model cannot take, before any rank is spawned or weight read."""
    for flag in ("tp", "pp", "ep", "vocab_multiple"):
        value = getattr(args, flag)
        if value < 1:
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"{name} must be a positive integer, got {value}" +
                             (" (the default, 128, suits every usual TP size)" if flag == "vocab_multiple" else ""))
    from actorcore.mcore.build.layout_check import check_layout
    from actorcore.mcore.parallel import McoreParallel

    check_layout(hf_config, McoreParallel(tp=args.tp, pp=args.pp, ep=args.ep), vocab_multiple=args.vocab_multiple,
                 as_flags=True)
    if args.mtp:
        from actorcore.mcore.build.model import mtp_layer_count

        mtp_layer_count(hf_config, True)  # refuses a model without MTP layers or rules, before any rank starts


def _hf_to_mcore(args: argparse.Namespace) -> None:
    from actorcore.mcore.parallel import McoreParallel

    from actorcore.model_files import check_model_dir

    src = os.path.abspath(args.src)
    _check_source_dir(src, "a local Hugging Face model directory (config.json + *.safetensors)")
    check_model_dir(src)  # every file it names stays inside it, every safetensors file is readable
    _check_layout(args, _read_hf_config(src))
    world = McoreParallel(tp=args.tp, pp=args.pp, ep=args.ep).world_size
    with atomic_output(args.dst) as out:
        task = (src, out, (args.tp, args.pp, args.ep), args.vocab_multiple, args.mtp)
        if world == 1:
            _hf_to_mcore_rank(0, 1, free_port(), *task)
            return
        with tempfile.TemporaryDirectory() as error_dir:
            codes = run_ranks(_spawned_rank, world, (free_port(), error_dir, task))
            if any(codes):
                messages = [open(os.path.join(error_dir, n)).read() for n in sorted(os.listdir(error_dir))]
                user = [m[5:] for m in messages if m.startswith("user:")]
                if user:
                    raise ValueError(user[0])
                details = "\n".join(m[4:] for m in messages) or f"rank exit codes {codes}"
                raise RuntimeError("conversion failed:\n" + details)


def _exporting(stream: Iterator[Any]) -> Iterator[Any]:
    """The stream, passing the ``exporting`` fault point once its first bucket is made (mid-export)."""
    for k, bucket in enumerate(stream):
        yield bucket
        if k == 0:
            fault_points.reach("exporting")


def _save_sharded(stream: Iterator[Any], hf_config: Any, out: str, max_shard_bytes: int) -> None:
    """The stream as sharded safetensors + index + config.json in the existing directory ``out`` (the CLI's own
    temporary output): written into a fresh directory inside it, then moved up."""
    from actorcore.export import save_sharded_safetensors

    weights = os.path.join(out, ".weights")
    save_sharded_safetensors(stream, weights, max_shard_bytes, config=hf_config)
    for name in sorted(os.listdir(weights)):
        os.replace(os.path.join(weights, name), os.path.join(out, name))
    os.rmdir(weights)


def _mcore_to_hf(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from actorcore.mcore.convert.dist_checkpoint import HF_DIR, copy_hf_side_files, load_mcore_checkpoint, read_mcore_metadata
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import mcore_weight_stream

    src = os.path.abspath(args.src)
    _check_source_dir(src, "a directory written by `actorcore convert hf-to-mcore`")
    positive_size("--max-shard-size", args.max_shard_size, hint="the default is 5368709120 (5 GiB)")
    meta, hf_config, dtype = read_mcore_metadata(src)
    from actorcore.archs import get_spec
    from actorcore.export.mxfp4 import quantize_stream_mxfp4, with_mxfp4_config, without_quantization_config

    if args.mxfp4 and not get_spec(hf_config.model_type).mcore.mxfp4_weights:
        raise ValueError(f"--mxfp4: {hf_config.model_type} names no MXFP4 weights (its releases store none); "
                         "export it without --mxfp4")
    with atomic_output(args.dst) as out, _megatron_runtime(0, 1, free_port()):
        initialize_megatron(McoreParallel())
        model = build_gpt_model(hf_config, McoreParallel(), dtype, vocab_multiple=int(meta["vocab_multiple"]),
                                mtp=bool(meta.get("mtp_layers")), expert_layout=meta.get("expert_layout"),
                                perform_initialization=False)  # the load fills all; export writes the source's layout
        fault_points.reach("loading")
        load_mcore_checkpoint(model, src)
        copy_hf_side_files(os.path.join(src, HF_DIR), out)
        # One process holds the whole model; the shards are written as the buckets come (one shard in memory).
        stream = mcore_weight_stream(model, bucket_bytes=min(args.max_shard_size, 512 * 1024**2))
        # The weights go out unquantized (MXFP4 experts on request): no config from the source may say otherwise.
        hf_config = without_quantization_config(hf_config)
        if args.mxfp4:
            stream = quantize_stream_mxfp4(stream, model.spec.mxfp4_weights)
            hf_config = with_mxfp4_config(hf_config)
        _save_sharded(tqdm(_exporting(stream), desc="export Megatron -> HF", unit="bucket"), hf_config, out,
                      args.max_shard_size)


def main(argv: list[str]) -> int:
    """Run one conversion; SIGINT / SIGTERM stop it cleanly (no process, no output, no temporary left)."""
    args = _parser().parse_args(argv)
    with SignalGuard() as guard:
        try:
            from actorcore.mcore._megatron import require_megatron

            require_megatron()
            if args.direction == "hf-to-mcore":
                _hf_to_mcore(args)
            else:
                _mcore_to_hf(args)
        except BaseException as exc:  # noqa: BLE001 - sorted below; bugs re-raised with their traceback
            if guard.signum is not None or isinstance(exc, (Interrupted, KeyboardInterrupt)):
                signum = guard.signum or signal.SIGINT
                print(f"error: interrupted by {signal.Signals(signum).name}; nothing was written to "
                      f"{os.path.abspath(args.dst)}", file=sys.stderr)
                return 128 + signum
            message = _user_message(exc)
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr)
            return EXIT_USER_ERROR
    print(f"wrote {os.path.abspath(args.dst)}")
    return 0


def _entry() -> Any:  # pragma: no cover - for `python -m actorcore.cli.convert`
    return sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":  # pragma: no cover
    _entry()
