"""Flat byte buffers that another process on the same machine can map, described by plain data only.

Two kinds, one interface (``allocate`` on the sending side, ``open_buffer`` on the receiving side):

- ``"cuda"``: a ``uint8`` CUDA tensor shared by a CUDA IPC memory handle (``UntypedStorage._share_cuda_``'s fields,
  rebuilt with torch's own ``rebuild_cuda_tensor``), plus an inter-process CUDA event the sender records after
  writing a bucket and the receiver's stream waits on before reading it (so the GPU never reads a half-written
  buffer, without the sender's CPU waiting for its GPU).
- ``"shm"``: a file in ``/dev/shm`` mapped shared by both processes (``torch.from_file(shared=True)`` on the sending
  side, ``mmap`` on the receiving side); the name travels, never a file descriptor or a pickled object. The sender
  unlinks it once the receiver has mapped it.

The receiving side hands out each bucket as views of ``bucket_view()``, a tensor with a storage of its own over the
buffer's memory, so the protocol can tell when the consumer has let go of a bucket (see ``ipc``).

The description of a buffer is a dict of ``str``/``int``/``bool`` (byte handles as hex strings), so it can travel
as JSON; the receiving side checks every field before using it (a path outside the shared-memory directory, a
size that disagrees with the file, an unknown kind is refused).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import tempfile
import uuid
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

ALIGN = 64  # every tensor starts at a multiple of this offset: any dtype's view of the bytes is then aligned
_SHM_NAME = re.compile(r"^actorcore-ipc-[0-9]+-[0-9a-f]{32}$")
_SHM_HANDLE = re.compile(rb"^/[A-Za-z0-9_]{1,200}$")  # torch's reference-counter file (shm_open name)
_CUDA_FIELDS = {"device": int, "handle": str, "size": int, "offset": int, "ref_handle": str, "ref_offset": int,
                "event_handle": str, "event_sync": bool, "ready_event": str}


def shm_dir() -> str:
    """Where shared-memory buffers live: ``/dev/shm`` on Linux, the temporary directory elsewhere."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def remove_file(path: str) -> None:
    """Unlink ``path`` if it is there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_files_of(pid: int) -> list[str]:
    """Unlink the shared-memory buffer files that the sending process ``pid`` created (their names carry its pid);
    the names removed. For the receiver of a sender that was killed (SIGKILL runs no cleanup), once no process has
    that pid any more: the mappings already made stay valid, only the names go."""
    prefix = f"actorcore-ipc-{pid}-"
    removed = [name for name in os.listdir(shm_dir()) if name.startswith(prefix) and _SHM_NAME.match(name)]
    for name in removed:
        remove_file(os.path.join(shm_dir(), name))
    return removed


class SendBuffer:
    """A flat ``uint8`` buffer of the sending side: ``tensor``, its plain-data ``description``, and the hooks the
    protocol calls around a bucket (``mark_written`` after packing, ``mark_mapped`` once the receiver has it)."""

    def __init__(self, kind: str, nbytes: int, device: torch.device, named: Callable[[str], None] | None = None):
        """``named(path)`` is called with a shared-memory buffer's file before the file exists: whoever holds the
        buffer can remove the file even when an interrupt lands between its creation and the buffer being held."""
        self.kind = kind
        self.nbytes = nbytes
        self._path: str | None = None
        self._ready = None
        if kind == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._ready = torch.cuda.Event(interprocess=True)
            self._ready.record(torch.cuda.current_stream(device))
            (dev, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync) = self.tensor.untyped_storage()._share_cuda_()
            self.description = dict(kind="cuda", nbytes=nbytes, device=int(dev), handle=bytes(handle).hex(),
                                    size=int(size), offset=int(offset), ref_handle=bytes(ref_handle).hex(),
                                    ref_offset=int(ref_offset), event_handle=bytes(event_handle or b"").hex(),
                                    event_sync=bool(event_sync), ready_event=bytes(self._ready.ipc_handle()).hex())
        elif kind == "shm":
            name = f"actorcore-ipc-{os.getpid()}-{uuid.uuid4().hex}"
            self._path = os.path.join(shm_dir(), name)
            if named is not None:
                named(self._path)
            try:
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, max(nbytes, 1))
                finally:
                    os.close(fd)
                self.tensor = torch.from_file(self._path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
            except BaseException:
                remove_file(self._path)
                raise
            self.description = dict(kind="shm", nbytes=nbytes, name=name)
        else:
            raise ValueError(f"buffer kind must be 'cuda' or 'shm', got {kind!r}")

    def mark_written(self) -> None:
        """After the bucket's copies were issued: the receiver's stream waits for this point (CUDA)."""
        if self._ready is not None:
            self._ready.record(torch.cuda.current_stream(self.tensor.device))

    def mark_mapped(self) -> None:
        """The receiver has mapped the buffer: its name is no longer needed (shared memory stays until unmapped)."""
        if self._path is not None:
            remove_file(self._path)
            self._path = None

    def release(self) -> None:
        self.mark_mapped()
        self.tensor = None


def _hex(description: dict, key: str) -> bytes:
    try:
        return bytes.fromhex(description[key])
    except ValueError as exc:
        raise ValueError(f"the buffer description's {key!r} is not a hex string") from exc


class ReceiveBuffer:
    """The receiving side's mapping of a ``SendBuffer`` from its ``description`` (checked field by field)."""

    def __init__(self, description: Any):
        if not isinstance(description, dict) or description.get("kind") not in ("cuda", "shm"):
            raise ValueError(f"a buffer description must be a dict with kind 'cuda' or 'shm', got {description!r}")
        nbytes = description.get("nbytes")
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"a buffer description's nbytes must be a non-negative int, got {nbytes!r}")
        self.kind = description["kind"]
        self.nbytes = nbytes
        self._ready = None
        self._mapping: mmap.mmap | None = None
        self.tensor: torch.Tensor | None = None
        if self.kind == "shm":
            self._mapping = self._open_shm(description, nbytes)
        else:
            self.tensor = self._open_cuda(description, nbytes)

    def bucket_view(self) -> torch.Tensor:
        """The whole buffer as a ``uint8`` tensor with a storage of its own (no copy): the tensors of one bucket
        are views of it, so ``StorageWeakRef`` of its storage tells whether the consumer still holds any of them
        (a view, a detached alias, ...), whatever else it holds of other buckets."""
        if self.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        if self._mapping is not None:
            return torch.frombuffer(self._mapping, dtype=torch.uint8, count=self.nbytes)
        return torch.as_tensor(_CudaView(self.tensor))

    @staticmethod
    def _open_shm(description: dict, nbytes: int) -> mmap.mmap:
        name = description.get("name")
        if not isinstance(name, str) or not _SHM_NAME.match(name):
            raise ValueError(f"a shared-memory buffer name must look like actorcore-ipc-<pid>-<hex>, got {name!r}")
        path = os.path.join(shm_dir(), name)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError as exc:
            raise ValueError(f"the shared-memory buffer {path} does not exist (the sender removed it, or runs on "
                             "another machine or in another container)") from exc
        if size != max(nbytes, 1):
            raise ValueError(f"the shared-memory buffer {path} has {size} bytes, the description says {nbytes}")
        fd = os.open(path, os.O_RDWR)
        try:
            return mmap.mmap(fd, max(nbytes, 1))  # the mapping outlives the file's name and this descriptor
        finally:
            os.close(fd)

    def _open_cuda(self, description: dict, nbytes: int) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        for key, kind in _CUDA_FIELDS.items():
            if type(description.get(key)) is not kind:
                raise ValueError(f"a CUDA buffer description needs {key!r} as {kind.__name__}, got "
                                 f"{description.get(key)!r}")
        if description["size"] < nbytes or description["offset"] < 0 or description["ref_offset"] < 0:
            raise ValueError(f"a CUDA buffer description with size {description['size']}, offset "
                             f"{description['offset']} cannot hold {nbytes} bytes")
        if not _SHM_HANDLE.match(_hex(description, "ref_handle")):
            raise ValueError("a CUDA buffer description's ref_handle must name a shared-memory object like torch's "
                             f"/torch_<pid>_<n>_<n>, got {_hex(description, 'ref_handle')[:64]!r}")
        if not torch.cuda.is_available() or not 0 <= description["device"] < torch.cuda.device_count():
            raise ValueError(f"the CUDA buffer is on device {description['device']}, which this process does not "
                             "see (the receiver must see the sender's GPU under the same CUDA_VISIBLE_DEVICES)")
        event_handle = _hex(description, "event_handle")
        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size([description["size"]]), (1,), 0, torch.UntypedStorage, torch.uint8,
            description["device"], _hex(description, "handle"), description["size"], description["offset"], False,
            _hex(description, "ref_handle"), description["ref_offset"], event_handle,
            description["event_sync"])
        self._ready = torch.cuda.Event.from_ipc_handle(description["device"], _hex(description, "ready_event"))
        return tensor[:nbytes]

    def wait_written(self) -> None:
        """Make this process's current stream wait until the sender's copies into the buffer are done (CUDA)."""
        if self._ready is not None:
            self._ready.wait(torch.cuda.current_stream(self.tensor.device))

    def done_reading(self) -> None:
        """Block until the work this process queued on the buffer has run, so the sender may overwrite it."""
        if self.kind == "cuda":
            torch.cuda.current_stream(self.tensor.device).synchronize()

    def release(self) -> None:
        self.tensor = None  # the bucket views the consumer still holds keep their memory mapped
        self._mapping = None
        self._ready = None


class _CudaView:
    """A CUDA tensor's bytes through ``__cuda_array_interface__``: ``torch.as_tensor`` of it is a tensor with a
    new storage over the same memory, which keeps this object (and so the rebuilt IPC tensor) alive."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor
        self.__cuda_array_interface__ = dict(shape=(tensor.numel(),), typestr="|u1", version=2,
                                             data=(tensor.data_ptr(), False), strides=None)
