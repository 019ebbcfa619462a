"""Disk transport: a weight stream written as sharded safetensors in the HF layout, atomically.

``model-0000k-of-0000n.safetensors`` files plus ``model.safetensors.index.json`` (``metadata.total_size`` and the
``weight_map``), and ``config.json`` when a config is given: what ``from_pretrained`` reads. Everything is written
into a temporary directory beside ``out_dir`` and renamed to ``out_dir`` at the end, so a failure (or a kill) leaves
no half-written ``out_dir``; a signal removes the temporary directory too, and a kill's is swept by the next write.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Iterable

import torch

from actorcore.export.stream import Bucket
from actorcore.lifecycle import make_temp_dir, new_file_mode, signals_blocked, signals_forwarded, sweep_stale_temps
from actorcore.sizes import positive_size

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"


def _shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def save_sharded_safetensors(stream: Iterable[Bucket], out_dir: str, max_shard_bytes: int = 5 * 1024**3, *,
                             config: Any = None, write: bool = True) -> dict[str, str]:
    """Write the stream to ``out_dir`` (which must not exist); return the weight map ``{name: shard file}``.

    A shard holds tensors in stream order up to ``max_shard_bytes``; a larger tensor gets a shard of its own. At most
    one shard is held in memory. ``config`` (a transformers config) is saved as ``config.json`` too.
    With a sharded model every rank must iterate the stream: pass ``write=False`` on all ranks but one, and those
    ranks only take part in the gathering (nothing is written, ``{}`` is returned).
    The directory and files get the modes the umask gives any new ones. The temporary directory
    (``.OUT.tmp-<pid>-<random>``) is removed on any error and on SIGINT / SIGTERM (the caller's handlers are
    replaced only while writing; the signal is then forwarded to them); one left by a killed process is removed by
    the next write to the same ``out_dir``.
    """
    max_shard_bytes = positive_size("max_shard_bytes", max_shard_bytes, hint="pass e.g. 5 * 1024**3 for 5 GiB")
    if not write:
        for _ in stream:
            pass
        return {}
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise ValueError(f"{out_dir} exists: choose a new directory (the export never overwrites one)")
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    sweep_stale_temps(out_dir)
    with signals_forwarded():
        tmp = make_temp_dir(out_dir)
        try:
            weight_map, total = _write_shards(stream, tmp, max_shard_bytes)
            if config is not None:
                config.save_pretrained(tmp)
            os.rename(tmp, out_dir)
        except BaseException:
            with signals_blocked():
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("wrote %d tensors (%d bytes) in %d shards to %s", len(weight_map), total,
                len(set(weight_map.values())), out_dir)
    return weight_map


def _write_shards(stream: Iterable[Bucket], tmp: str, max_shard_bytes: int) -> tuple[dict[str, str], int]:
    """The shards and the index into the directory ``tmp``; the weight map and the total bytes."""
    from safetensors.torch import save_file

    mode = new_file_mode()  # safetensors makes its files 0600 whatever the umask
    shard_files: list[list[str]] = []  # names per shard, in order
    seen: set[str] = set()
    shard: dict[str, torch.Tensor] = {}
    used = total = 0

    def flush() -> None:
        nonlocal shard, used
        if shard:
            path = os.path.join(tmp, f"shard-{len(shard_files):05d}.tmp")
            save_file(shard, path, metadata={"format": "pt"})
            os.chmod(path, mode)
            shard_files.append(list(shard))
            shard, used = {}, 0

    for bucket in stream:
        for name, tensor in bucket:
            if name in seen:
                raise ValueError(f"save_sharded_safetensors: the stream sent {name!r} twice")
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            if shard and used + nbytes > max_shard_bytes:
                flush()
            shard[name] = tensor.detach().to("cpu").contiguous()
            used += nbytes
            total += nbytes
    flush()
    if not shard_files:
        raise ValueError("save_sharded_safetensors: the stream was empty")
    n = len(shard_files)
    weight_map = {}
    for k, names in enumerate(shard_files):
        final = _shard_name(k + 1, n)
        os.rename(os.path.join(tmp, f"shard-{k:05d}.tmp"), os.path.join(tmp, final))
        weight_map.update({name: final for name in names})
    with open(os.path.join(tmp, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return weight_map, total
