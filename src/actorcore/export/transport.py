"""Process-group transport of a weight stream: ``broadcast_stream`` sends each bucket from one rank to the others.

Per bucket, one broadcast of its layout (names, shapes, dtypes: a small JSON list, never a pickle) and one broadcast
of its bytes (every tensor of the bucket packed into one flat ``uint8`` buffer), so the receivers rebuild bitwise the
same tensors. An empty layout ends the stream. The collectives are ``parallel.collectives``'; the group is the
caller's: a group of the default world, or one made outside it (an engine's workers joining a trainer).
"""

from __future__ import annotations

import json
import logging
from typing import Iterable, Iterator

import torch

from actorcore.export.ipc import DTYPES
from actorcore.export.stream import Bucket
from actorcore.parallel import collectives

logger = logging.getLogger(__name__)


def _pack(bucket: Bucket) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], torch.Tensor]:
    layout = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    return layout, torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def _unpack(layout: list[tuple[str, tuple[int, ...], torch.dtype]], buffer: torch.Tensor) -> Bucket:
    out: Bucket = []
    offset = 0
    for name, shape, dtype in layout:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out.append((name, buffer[offset:offset + nbytes].view(dtype).reshape(shape)))
        offset += nbytes
    return out


def _encode_layout(layout: list[tuple[str, tuple[int, ...], torch.dtype]]) -> bytes:
    names = {dtype: name for name, dtype in DTYPES.items()}
    return json.dumps([[name, list(shape), names[dtype]] for name, shape, dtype in layout]).encode()


def _decode_layout(data: bytes) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    try:
        entries = json.loads(data.decode())
        layout = [(str(name), tuple(int(d) for d in shape), DTYPES[dtype]) for name, shape, dtype in entries]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"broadcast_stream: a malformed bucket layout arrived ({exc})") from exc
    if any(d < 0 for _, shape, _ in layout for d in shape):
        raise ValueError("broadcast_stream: a bucket layout with a negative size arrived")
    return layout


def broadcast_stream(stream: Iterable[Bucket] | None, group, src: int, *,
                     device: torch.device | str = "cpu") -> Iterator[Bucket]:
    """Yield the buckets of group rank ``src``'s ``stream`` on EVERY rank of ``group`` (``src`` included).

    Every rank of ``group`` must iterate the returned generator to its end, in step: ``src`` passes its stream
    (e.g. ``hf_weight_stream(model)``), the others pass ``None``. Received tensors are bitwise the sent ones (same
    names, shapes, dtypes), placed on ``device`` (over NCCL: the rank's CUDA device; the sender's tensors are
    moved there too). When ``src``'s stream gathers over an FSDP mesh, the other ranks of that mesh must iterate
    their own ``hf_weight_stream`` of the model at the same time (and may discard it): only ``src``'s is read here.
    Memory: one bucket's tensors plus one flat copy of its bytes at a time. A received bucket's tensors are views
    of that one buffer: copy them out (as every receiver does) rather than keeping them.
    """
    rank = collectives.group_rank(group)
    if (rank == src) != (stream is not None):
        raise ValueError(f"broadcast_stream: group rank {rank} passed "
                         f"{'no stream' if stream is None else 'a stream'}, but src is {src}: the sending rank "
                         "passes its stream, every other rank passes None")
    iterator = iter(stream) if stream is not None else None
    sent = 0
    while True:
        if iterator is not None:
            bucket = next(iterator, None)
            layout, buffer = _pack(bucket) if bucket is not None else ([], None)
            if bucket is not None and not layout:
                continue  # an empty bucket carries nothing, and an empty layout would end the stream
        else:
            layout, buffer = None, None
        layout = _decode_layout(collectives.broadcast_bytes(_encode_layout(layout) if iterator is not None else None,
                                                            src, group, device))
        if not layout:
            logger.debug("broadcast_stream: %d buckets", sent)
            return
        if buffer is None:
            nbytes = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d in layout)
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            buffer = buffer.to(device)
        collectives.broadcast_tensor(buffer, src, group)
        sent += 1
        yield _unpack(layout, buffer)
