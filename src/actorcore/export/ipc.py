"""Same-machine transport of a weight stream to another process: ``ipc_send`` / ``ipc_receive``.

The sender packs buckets into one of two flat buffers (CUDA IPC memory on the GPU, shared memory on the CPU: see
``ipc_buffers``) and tells the receiver where each tensor lies; the receiver yields ``(name, tensor)`` views of the
buffer and acknowledges a bucket once its consumer asks for the next one. Double-buffered: while the receiver loads
bucket k from one buffer, the sender gathers and packs bucket k+1 into the other; a buffer is written again only
after its acknowledgement. Extra memory on the sending side: two buffers plus one bucket of the stream.

Lifetime of a received tensor: as long as the consumer holds it (or any view or alias of it). Nothing is copied:
each bucket's tensors are views of a storage of that bucket's own over the buffer (``ReceiveBuffer.bucket_view``),
so when the consumer asks for the next bucket the receiver can tell whether it still holds any of them. If it
does not (``load_into``, vLLM's and SGLang's loaders copy and let go), the acknowledgement frees the buffer for
the sender's next bucket, as before. If it does (a disk writer holding a shard's tensors), the acknowledgement says
``held``: the sender never writes that buffer again and ships the next bucket in a new one; the held memory is
freed when the consumer drops the last tensor (memory, not copies: what it holds, it holds in place).

The channel is the caller's: a ``multiprocessing.connection.Connection`` (``send_bytes`` / ``recv_bytes``), or any
object with ``send`` / ``recv`` of strings. Every message is JSON (names, shapes, dtype strings, offsets and the
buffers' handle fields), so nothing received is unpickled or can run code, and every field is checked.

Messages, sender -> receiver: ``hello`` (version, pid); ``bucket`` (slot, a new buffer description when the slot's
buffer is new, the tensors' ``[name, dtype, shape, offset]``); ``end`` (counts); ``abort`` (reason). Receiver ->
sender: ``ready`` (version, pid); ``ack`` (slot, sequence number, ``held``); ``closed`` (after ``end``: it has let
go of the buffers, which the sender then frees at once rather than leaving CUDA IPC blocks to torch's limbo);
``abort`` (reason). Either side that fails sends ``abort`` (best effort) and the other raises ``TransportError``
with that reason. A peer whose process died is noticed without any timeout: by the channel closing, or, where its
end of the channel stays open in another process, by its pid (from hello / ready) no longer running, checked every
``PEER_CHECK_S`` while waiting. SIGINT / SIGTERM in ``ipc_send`` free the buffers (no file is left in
``/dev/shm``) before the caller's handler, or the default action, takes the signal. A sender killed outright
(SIGKILL) frees nothing: its receiver, once that process is gone, unlinks the shared-memory files it left.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from actorcore.export.ipc_buffers import ALIGN, ReceiveBuffer, SendBuffer, remove_file, remove_files_of
from actorcore.export.stream import DEFAULT_BUCKET_BYTES, Bucket
from actorcore.errors import TransportError  # noqa: F401 (re-exported)
from actorcore.lifecycle import pid_alive, process_identity, signals_forwarded
from actorcore.sizes import positive_size

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 2
PEER_CHECK_S = 0.5  # while waiting for a message: how often the other side's process is checked
PEER_EXIT_S = 2.0  # how long a peer whose channel closed may take to exit before its buffers are swept
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
                "uint16", "uint32", "uint64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
DTYPES = {name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)}
_DTYPE_TO_NAME = {dtype: name for name, dtype in DTYPES.items()}


class _Channel:
    """JSON messages over the caller's channel; ``recv`` waits at most ``timeout`` seconds where it can poll."""

    def __init__(self, channel: Any, timeout: float | None, side: str):
        self._bytes = callable(getattr(channel, "send_bytes", None)) and callable(getattr(channel, "recv_bytes", None))
        if not self._bytes and not (callable(getattr(channel, "send", None)) and callable(getattr(channel, "recv",
                                                                                                      None))):
            raise ValueError(f"the channel must have send_bytes/recv_bytes (a multiprocessing Connection) or "
                             f"send/recv, got {type(channel).__name__}")
        if timeout is not None:
            timeout = positive_size("timeout", timeout, unit="seconds", integer=False,
                                    hint="pass e.g. 60.0, or None to wait as long as the other side's process runs")
        self._channel = channel
        self._timeout = timeout
        self._side = side
        self._peer: tuple[int, str | None] | None = None  # (pid, start time) once the other side said hello
        self.peer_gone = False  # the other side's process ended, or closed the channel (it may be ending)

    def set_peer(self, message: dict) -> None:
        """Watch the process that sent ``message`` (hello / ready): a peer that dies is noticed while waiting,
        also when its end of the channel stays open in another process (a parent that did not close the child's
        end of a ``Pipe``). Only where both sides see the same process ids (same pid namespace)."""
        pid, identity, namespace = message.get("pid"), message.get("identity"), message.get("pid_namespace")
        if type(pid) is int and pid > 0 and namespace == _pid_namespace() and pid != os.getpid():
            self._peer = (pid, identity if isinstance(identity, str) else None)

    def _wait(self, waiting_for: str) -> None:
        """Until a message is there: raise ``TransportError`` if the peer's process ended or ``timeout`` passed."""
        poll = getattr(self._channel, "poll", None)
        if not callable(poll) or (self._timeout is None and self._peer is None):
            return  # nothing to watch with: recv blocks (a closed channel still ends it)
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            step = PEER_CHECK_S if deadline is None else max(0.0, min(PEER_CHECK_S, deadline - time.monotonic()))
            if poll(step):
                return
            if self._peer is not None and not pid_alive(*self._peer):
                self.peer_gone = True
                raise TransportError(f"{self._side}: the other side's process (pid {self._peer[0]}) ended while "
                                     f"this side waited for {waiting_for}")
            if deadline is not None and time.monotonic() >= deadline:
                raise TransportError(f"{self._side}: no {waiting_for} from the other side within {self._timeout} s")

    def send(self, message: dict) -> None:
        data = json.dumps(message)
        try:
            self._channel.send_bytes(data.encode()) if self._bytes else self._channel.send(data)
        except (BrokenPipeError, ConnectionError, EOFError, OSError) as exc:
            self.peer_gone = True
            raise TransportError(f"{self._side}: the other side closed the channel ({exc}); did its process "
                                 "die?") from exc

    def remove_dead_peers_buffers(self, wait_s: float = PEER_EXIT_S) -> None:
        """After the other side vanished (a SIGKILLed sender frees nothing): once no process has its pid any more
        (waiting up to ``wait_s`` for one whose channel closed as it exits), unlink the shared-memory buffers it
        left in ``shm_dir()``. A pid already reused by another process is left alone, and so are its files."""
        if not self.peer_gone or self._peer is None:
            return
        pid = self._peer[0]
        deadline = time.monotonic() + wait_s
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if pid_alive(pid):
            return
        removed = remove_files_of(pid)
        if removed:
            logger.warning("%s: the other side (pid %d) ended without freeing %d shared-memory buffers: removed %s",
                           self._side, pid, len(removed), ", ".join(removed))

    def try_send(self, message: dict) -> None:
        try:
            self.send(message)
        except Exception:  # noqa: BLE001 - best effort while already failing
            logger.debug("%s: could not send %s", self._side, message.get("op"))

    def raise_pending_abort(self) -> None:
        """While failing on a message: if the other side has already sent ``abort`` (it failed first, and freed
        what that message described), raise its reason instead."""
        poll = getattr(self._channel, "poll", None)
        for _ in range(4):
            if not callable(poll) or not poll(0.2):
                return
            try:
                self.recv("an abort")
            except TransportError:
                raise
            except Exception:  # noqa: BLE001 - any other message: keep the caller's error
                pass

    def recv(self, waiting_for: str) -> dict:
        self._wait(waiting_for)
        try:
            raw = self._channel.recv_bytes() if self._bytes else self._channel.recv()
        except (EOFError, ConnectionError, OSError) as exc:
            self.peer_gone = True
            raise TransportError(f"{self._side}: the other side closed the channel while this side waited for "
                                 f"{waiting_for} (did its process die?)") from exc
        try:
            message = json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self._side}: a message that is not JSON text arrived: {str(raw)[:80]!r}") from exc
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise ValueError(f"{self._side}: a message must be a JSON object with an 'op', got {str(message)[:80]}")
        if message["op"] == "abort":
            raise TransportError(f"{self._side}: the other side stopped: {message.get('reason')}")
        return message


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _introduction(op: str) -> dict:
    """hello / ready: the protocol version and who is speaking (so that the other side can watch this process)."""
    return dict(op=op, version=PROTOCOL_VERSION, pid=os.getpid(), identity=process_identity(os.getpid()),
                pid_namespace=_pid_namespace())


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


@dataclass
class IpcSendStats:
    """What ``ipc_send`` moved: buffers shipped, tensors, payload bytes, the buffers' capacity, how many buffers
    were packed while the other one was still being read (the double buffering at work), how many buffers were
    retired because the receiver's consumer still held their tensors (each replaced by a new one), seconds."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    buffer_bytes: int = 0
    overlapped: int = 0
    retired: int = 0
    seconds: float = 0.0


class _Sender:
    def __init__(self, channel: _Channel, buffer_bytes: int, buffers: int, device: torch.device | None):
        self.channel = channel
        self.capacity = buffer_bytes
        self.kind: str | None = None
        self.device = device
        self.buffers: list[SendBuffer | None] = [None] * buffers
        self.announced = [False] * buffers
        self.in_flight: deque[tuple[int, int]] = deque()  # (slot, seq) shipped, not acknowledged, in order
        self.stats = IpcSendStats(buffer_bytes=buffer_bytes)
        self.slot = 0
        self.layout: list[list] = []
        self.used = 0
        self.files: list[str] = []  # every shared-memory file a buffer was created under (removed by release)

    def _wait_ack(self) -> None:
        slot, seq = self.in_flight[0]
        message = self.channel.recv(f"the acknowledgement of bucket {seq}")
        if (message.get("op") != "ack" or message.get("slot") != slot or message.get("seq") != seq
                or type(message.get("held")) is not bool):
            raise ValueError(f"sender: expected the acknowledgement of bucket {seq} (slot {slot}), got {message}")
        self.in_flight.popleft()
        self.buffers[slot].mark_mapped()
        if message["held"]:  # the consumer keeps tensors of it: never written again, the next one is new
            self.buffers[slot].release()
            self.buffers[slot] = None
            self.stats.retired += 1

    def _acquire(self, slot: int, need: int) -> SendBuffer:
        """The slot's buffer, free (acknowledged) and at least ``need`` bytes (reallocated, once free, if not)."""
        while any(s == slot for s, _ in self.in_flight):
            self._wait_ack()
        buffer = self.buffers[slot]
        if buffer is None or buffer.nbytes < need:
            if buffer is not None:
                buffer.release()
                logger.info("ipc_send: a bucket of %d bytes is larger than the buffer: growing buffer %d", need, slot)
            if self.kind == "cuda" and self.stats.retired:
                torch.cuda.ipc_collect()  # frees retired buffers whose tensors the receiver has let go of since
            self.buffers[slot] = buffer = SendBuffer(self.kind, _aligned(max(need, self.capacity, ALIGN)),
                                                     self.device, named=self.files.append)
            self.announced[slot] = False
            self.stats.buffer_bytes = max(self.stats.buffer_bytes, buffer.nbytes)
        return buffer

    def _ship(self) -> None:
        buffer = self.buffers[self.slot]
        buffer.mark_written()
        seq = self.stats.buckets
        message = dict(op="bucket", seq=seq, slot=self.slot, tensors=self.layout,
                       buffer=None if self.announced[self.slot] else buffer.description)
        self.channel.send(message)
        self.announced[self.slot] = True
        self.in_flight.append((self.slot, seq))
        self.stats.buckets += 1
        self.slot = (self.slot + 1) % len(self.buffers)
        self.layout, self.used = [], 0

    def add(self, bucket: Bucket) -> None:
        if not bucket:
            return
        if self.kind is None:
            first = bucket[0][1]
            self.device = torch.device(self.device) if self.device is not None else first.device
            self.kind = "cuda" if self.device.type == "cuda" else "shm"
        sizes = []
        for entry in bucket:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], torch.Tensor)):
                raise ValueError(f"ipc_send: a bucket must hold (name, tensor) pairs, got {type(entry).__name__}")
            name, tensor = entry
            if tensor.dtype not in _DTYPE_TO_NAME:
                raise ValueError(f"ipc_send: {name!r} has dtype {tensor.dtype}, which the transport does not carry")
            sizes.append(_aligned(tensor.numel() * tensor.element_size()))
        need = sum(sizes)
        if self.layout and self.used + need > self.buffers[self.slot].nbytes:
            self._ship()
        if not self.layout:
            buffer = self._acquire(self.slot, need)
            if any(s != self.slot for s, _ in self.in_flight):
                self.stats.overlapped += 1  # packing while the other buffer is not yet acknowledged
        else:
            buffer = self.buffers[self.slot]
        with torch.no_grad():
            for (name, tensor), size in zip(bucket, sizes):
                nbytes = tensor.numel() * tensor.element_size()
                view = buffer.tensor[self.used:self.used + nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor.detach())
                self.layout.append([name, _DTYPE_TO_NAME[tensor.dtype], list(tensor.shape), self.used])
                self.used += size
                self.stats.tensors += 1
                self.stats.bytes += nbytes

    def finish(self) -> None:
        if self.layout:
            self._ship()
        while self.in_flight:
            self._wait_ack()
        self.channel.send(dict(op="end", buckets=self.stats.buckets, tensors=self.stats.tensors))
        closed = self.channel.recv("the receiver's closed")  # it let go of the buffers: they can be freed now
        if closed.get("op") != "closed":
            raise ValueError(f"ipc_send: expected the receiver's closed after end, got {closed}")

    def release(self) -> None:
        for buffer in self.buffers:
            if buffer is not None:
                buffer.release()
        self.buffers = [None] * len(self.buffers)
        for path in self.files:  # also a file whose buffer an interrupt kept from reaching self.buffers
            remove_file(path)
        self.files.clear()
        if self.kind == "cuda":
            torch.cuda.ipc_collect()  # frees the blocks the receiver has let go of


def ipc_send(stream: Iterable[Bucket], channel: Any, *, buffer_bytes: int = DEFAULT_BUCKET_BYTES, buffers: int = 2,
             device: torch.device | str | None = None, timeout: float | None = None) -> IpcSendStats:
    """Send every bucket of ``stream`` to the process reading ``channel`` with ``ipc_receive``; return stats.

    Buckets are packed, in order, into flat buffers of ``buffer_bytes`` (consecutive small buckets share one; a
    bucket larger than that gets a buffer grown to its size). ``buffers=2`` (default): packing the next buffer
    overlaps the receiver's load of the previous one; extra memory two buffers plus the stream's gathered bucket
    (nothing more for an unsharded model or FSDP2 on one GPU, where gathering is free). ``buffers=1``: the stream's
    next gathered bucket is the second buffer: the gathering still overlaps the receiver's load, the packing waits
    for it; extra memory one buffer plus one gathered bucket (a sharded model with the memory bound of 2 buckets).
    ``device``: where the buffers live, by default the first tensor's device: CUDA -> CUDA IPC (the receiver must
    be on the same GPU), CPU -> shared memory. Returns after the receiver acknowledged the last bucket.
    ``timeout``: seconds to wait for any one answer (where the channel can poll); ``None`` waits as long as the
    receiver's process runs (its death is noticed within ``PEER_CHECK_S``, also while another process still holds
    its end of the channel). A buffer whose tensors the receiver's consumer still holds is retired, and the next
    bucket goes into a new one (``IpcSendStats.retired``). With an FSDP2 stream, every rank iterates its own stream; only the
    rank that holds the channel calls ``ipc_send`` (if it fails, the other ranks are left inside a gather: end
    the job, as after any failed collective).
    Raises ``TransportError`` when the receiver stops (its reason is in the message) or its process dies; on any
    error or interrupt here the receiver is told (``abort``) and the buffers are freed.
    """
    buffer_bytes = positive_size("buffer_bytes", buffer_bytes)
    if buffers not in (1, 2):
        raise ValueError(f"buffers must be 1 or 2, got {buffers}")
    start = time.perf_counter()
    link = _Channel(channel, timeout, "ipc_send")
    sender = _Sender(link, _aligned(buffer_bytes), buffers, device)
    with signals_forwarded():  # SIGTERM too runs the cleanup below (no buffer left in /dev/shm), then goes on
        try:
            link.send(_introduction("hello"))
            ready = link.recv("the receiver's ready")
            if ready.get("op") != "ready" or ready.get("version") != PROTOCOL_VERSION:
                raise ValueError(f"ipc_send: the receiver answered {ready} to protocol version {PROTOCOL_VERSION} "
                                 "(both sides must run the same actorcore version)")
            link.set_peer(ready)
            for bucket in stream:
                sender.add(bucket)
                del bucket
            sender.finish()
        except TransportError:
            raise  # the receiver stopped or vanished: nothing to tell it
        except BaseException as exc:
            link.try_send(dict(op="abort", reason=f"ipc_send failed: {type(exc).__name__}: {exc}"))
            raise
        finally:
            sender.release()
    sender.stats.seconds = time.perf_counter() - start
    logger.info("ipc_send: %d tensors, %d bytes in %d buffers in %.3f s", sender.stats.tensors, sender.stats.bytes,
                sender.stats.buckets, sender.stats.seconds)
    return sender.stats


def _check_layout(tensors: Any, nbytes: int) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    if not isinstance(tensors, list) or not tensors:
        raise ValueError("ipc_receive: a bucket message must list its tensors")
    out = []
    for entry in tensors:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and isinstance(entry[2], list) and all(type(d) is int and d >= 0 for d in entry[2])
                and type(entry[3]) is int):
            raise ValueError(f"ipc_receive: a tensor entry must be [name, dtype, shape, offset], got {entry!r}")
        name, dtype_name, shape, offset = entry
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise ValueError(f"ipc_receive: {name!r} has dtype {dtype_name!r}; known: {sorted(DTYPES)}")
        size = _nbytes(shape, dtype)
        if offset < 0 or offset % ALIGN or offset + size > nbytes:
            raise ValueError(f"ipc_receive: {name!r} at offset {offset} with {size} bytes does not fit an aligned "
                             f"place in the buffer of {nbytes} bytes")
        out.append((name, dtype, tuple(shape), offset))
    return out


class IpcReceiver:
    """The receiving side: iterate it for buckets of ``(name, tensor)``; tensors are views of the shared buffer,
    valid for as long as the consumer holds them (see the module docstring: a held bucket's buffer is retired, not
    rewritten; nothing is copied).

    Use it as a context manager so an error of the consumer (``load_into`` refusing a name) reaches the sender as
    its ``TransportError`` message instead of a time-out::

        with ipc_receive(conn) as stream:
            load_into(model, stream)
    """

    def __init__(self, channel: Any, timeout: float | None = None):
        self._channel = _Channel(channel, timeout, "ipc_receive")
        self._buffers: list[ReceiveBuffer | None] = [None, None]
        self._finished = False
        self._stopped = False  # an abort was sent or received: say nothing more
        self._generator: Iterator[Bucket] | None = None

    def __iter__(self) -> Iterator[Bucket]:
        if self._generator is not None:
            raise ValueError("ipc_receive: a receiver is iterated once")
        self._generator = self._buckets()
        return self._generator

    def _abort(self, reason: str) -> None:
        if not self._finished and not self._stopped:
            self._stopped = True
            self._channel.try_send(dict(op="abort", reason=reason))

    def _buckets(self) -> Iterator[Bucket]:
        try:
            hello = self._channel.recv("the sender's hello")
            if hello.get("op") != "hello" or hello.get("version") != PROTOCOL_VERSION:
                raise ValueError(f"ipc_receive: expected hello of protocol version {PROTOCOL_VERSION}, got "
                                 f"{str(hello)[:200]} (both sides must run the same actorcore version)")
            self._channel.set_peer(hello)
            self._channel.send(_introduction("ready"))
            seq = 0
            while True:
                message = self._channel.recv(f"bucket {seq}")
                if message["op"] == "end":
                    if message.get("buckets") != seq:
                        raise ValueError(f"ipc_receive: the sender ended after {message.get('buckets')} buckets, "
                                         f"{seq} arrived")
                    self._finished = True
                    self._buffers = [None, None]
                    self._channel.send(dict(op="closed"))
                    return
                slot = message.get("slot")
                if message["op"] != "bucket" or message.get("seq") != seq or slot not in (0, 1):
                    raise ValueError(f"ipc_receive: expected bucket {seq} in slot 0 or 1, got {str(message)[:200]}")
                if message.get("buffer") is not None:
                    self._buffers[slot] = None  # drop the old mapping first
                    self._buffers[slot] = ReceiveBuffer(message["buffer"])
                buffer = self._buffers[slot]
                if buffer is None:
                    raise ValueError(f"ipc_receive: bucket {seq} uses slot {slot}, which no buffer was sent for")
                layout = _check_layout(message.get("tensors"), buffer.nbytes)
                buffer.wait_written()
                whole = buffer.bucket_view()  # a storage of this bucket's own: is it still held when we ack?
                watch = StorageWeakRef(whole.untyped_storage())
                bucket = [(name, whole[offset:offset + _nbytes(shape, dtype)].view(dtype).view(shape))
                          for name, dtype, shape, offset in layout]
                del whole
                yield bucket
                del bucket
                buffer.done_reading()
                held = not watch.expired()
                if held:  # the consumer keeps some of its tensors: the sender retires the buffer, sends a new one
                    self._buffers[slot] = None
                    logger.debug("ipc_receive: bucket %d is still held by the consumer: its buffer is retired", seq)
                self._channel.send(dict(op="ack", slot=slot, seq=seq, held=held))
                seq += 1
        except TransportError:
            self._stopped = True
            self._channel.remove_dead_peers_buffers()
            raise
        except GeneratorExit:
            self._abort("the receiver stopped reading before the end of the stream")
            raise
        except ValueError as exc:
            try:
                self._channel.raise_pending_abort()
            except TransportError:
                self._stopped = True
                raise
            self._abort(f"ipc_receive failed: {type(exc).__name__}: {exc}")
            raise
        except BaseException as exc:
            self._abort(f"ipc_receive failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._buffers = [None, None]

    def __enter__(self) -> "IpcReceiver":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self._abort(f"the receiving side failed: {exc_type.__name__}: {exc}")
        elif not self._finished:
            self._abort("the receiver stopped reading before the end of the stream")
        if self._generator is not None:
            self._generator.close()


def ipc_receive(channel: Any, *, timeout: float | None = None) -> IpcReceiver:
    """The receiving end of ``ipc_send`` over ``channel``: iterate it (once) for buckets of ``(name, tensor)``.

    Same GPU as the sender for CUDA buffers (rebuilt from CUDA IPC handles with torch's ``rebuild_cuda_tensor``),
    or the same machine for shared memory. Each bucket's tensors are views of a shared buffer, without a copy, and
    stay valid for as long as the consumer holds them: when the next bucket is asked for, the bucket is acknowledged
    (after this process's current CUDA stream has finished reading it); a buffer whose tensors are still held is
    never rewritten (the sender uses a new one), a released one is reused. Holding every bucket holds the whole
    stream's memory. Raises ``TransportError`` when the sender stops or dies, and ``ValueError`` on a malformed
    message.
    """
    return IpcReceiver(channel, timeout)
