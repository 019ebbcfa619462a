"""Activation offload: the inputs that gradient checkpointing keeps wait in pinned CPU memory until backward.

Why: with gradient checkpointing each decoder layer keeps only its input hidden states until backward, but at
long length those fill the GPU (Llama-8B in bf16: 8 KiB per token per layer, 128 GiB at 512K tokens over 32
layers). Here they live in pinned host memory instead, and the copies run on a side CUDA stream so they hide
behind the layers' compute. Where host memory is short, only the first K layers offload (``offload_layers``):
the last layers' inputs, which backward needs first, stay on the GPU.

How, for one decoder call (``offloaded_layers``): each decoder layer's ``_gradient_checkpointing_func`` (the
per-layer checkpoint function transformers calls as ``func(partial(forward, **kwargs), *args)``: torch's
non-reentrant ``checkpoint``, or the compiled decoder's ``InGraphCheckpoint``) is wrapped by an
``OffloadedCheckpoint`` that runs it inside the ``saved_tensors_hooks`` of the call's ``ActivationOffloader``.
Non-reentrant checkpoint saves its positional inputs through the hooks in force (ours) and only then installs its
own hooks for the layer's body; a compiled layer checkpointed inside its graph saves its inputs, parameters and the
rotary tables through them. Exactly the positional inputs (the hidden states) move, by their storage; the rest stays
where it is.

- pack (forward), offloaded layer: the side stream waits for the compute stream and copies the tensor's bytes
  into host chunks from the ``PinnedPool`` without blocking; ``record_stream`` keeps its device block from reuse
  until the copy is done; the device tensor is released at once. Kept layer: the tensor stays as it is.
- unpack (backward, when the checkpoint recomputes a layer): that layer's input comes back (unless it was
  prefetched) and the input of the layer before it, the next one backward reaches, is prefetched (from a kept
  layer too, so the last offloaded layer is under way before backward reaches it); both copies run on the side
  stream into memory allocated on the compute stream, which waits only for its own tensor.
- Host memory: chunks of at most ``CHUNK_BYTES`` (powers of two, so torch's pinned allocator, which rounds up to
  one, wastes nothing) go back to the pool when the saved input dies (after its layer's backward, or when the
  graph is dropped), and the next call reuses them; ``release_offload_buffers()`` (and reverting an
  offload patch) frees the idle ones.
- Not CUDA: the copies are synchronous; on the CPU they are copies in CPU memory (the mechanics, tested there).

Exact: the recomputation reads the same bits with the same shape, strides and dtype; nothing else changes.
The wrappers live for one forward (the unpack hooks travel with the saved tensors into backward), and hold
the call's offloader, never a module, so nothing stays installed on the model, also when the forward or the
backward is interrupted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections import Counter, defaultdict
from typing import Any, Iterator

import torch
import torch.utils.checkpoint

from actorcore.errors import PatchNotAppliedError
from actorcore.hf.call import DecoderCall
from actorcore.hf.features.base import DecoderFeature
from actorcore.hf.features.compiled_decoder import InGraphCheckpoint
from actorcore.hf.features.plan import FeatureOption, PlanFacts

logger = logging.getLogger(__name__)

# Trace keys, counted per call: layers run under the offload hooks whose input moved, layers whose input stayed
# on the device (partial offload), tensors moved out and their bytes, tensors brought back, how many of those
# were prefetched ahead of their layer's recompute, and the host bytes newly allocated (0 once the pool is warm).
OFFLOAD_LAYERS = "offload:layers"
OFFLOAD_KEPT = "offload:kept_layers"
OFFLOAD_TENSORS = "offload:tensors"
OFFLOAD_BYTES = "offload:bytes"
OFFLOAD_RESTORED = "offload:restored"
OFFLOAD_PREFETCHED = "offload:prefetched"
OFFLOAD_HOST_ALLOCATED = "offload:host_bytes_allocated"

# Offloaded inputs on the device at once in backward: the one a layer's recompute reads and the one prefetched ahead
# of it (in the forward, each waits there only until its copy to the host is done). The budget planner counts them.
OFFLOAD_IN_FLIGHT = 2

CHUNK_BYTES = 64 << 20  # a tensor is copied in chunks of this size (and a power-of-two tail)
_MIN_BLOCK = 512

_ENABLE_HINT = ("model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
                "(transformers >= 5.24: activation_checkpointing_enable(activation_checkpointing_kwargs="
                "{'use_reentrant': False}))")


def chunk_sizes(nbytes: int) -> list[int]:
    """The host blocks holding ``nbytes``: full chunks and a power-of-two tail (so sizes repeat across lengths)."""
    full, tail = divmod(nbytes, CHUNK_BYTES)
    return [CHUNK_BYTES] * full + ([max(_MIN_BLOCK, 1 << (tail - 1).bit_length())] if tail else [])


def host_bytes(nbytes: int) -> int:
    """Host memory one offloaded tensor of ``nbytes`` occupies."""
    return sum(chunk_sizes(nbytes))


class HostChunk:
    """One host block and the CUDA event after the last copy that used it (reuse waits for it)."""

    __slots__ = ("buffer", "pinned", "event")

    def __init__(self, buffer: torch.Tensor, pinned: bool) -> None:
        self.buffer = buffer
        self.pinned = pinned
        self.event: Any = None


class PinnedPool:
    """Host blocks for offloaded tensors, reused across calls and models of this process.

    Blocks come back when the tensor they hold dies and wait, idle, for the next tensor (a tail takes the smallest
    idle block that fits); the pool therefore holds about what was in use at once (the largest call), until
    ``release`` frees the idle ones.
    Thread-safe: backward (and the garbage collector) may return blocks from another thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[int, bool], list[HostChunk]] = defaultdict(list)
        self.in_use_bytes = 0
        self.idle_bytes = 0
        self.allocated_blocks = 0  # blocks ever allocated (reuse shows as this not growing)

    def take(self, nbytes: int, pinned: bool) -> tuple[list[HostChunk], int]:
        """Blocks for ``nbytes`` and how many bytes of them were newly allocated."""
        chunks, new = [], 0
        for size in chunk_sizes(nbytes):
            with self._lock:
                chunk = self._idle_block(size, pinned)
                if chunk is not None:
                    size = chunk.buffer.numel()
                    self.idle_bytes -= size
                self.in_use_bytes += size
            if chunk is None:
                try:
                    chunk = HostChunk(torch.empty(size, dtype=torch.uint8, pin_memory=pinned), pinned)
                except BaseException:
                    self.give(chunks)
                    with self._lock:
                        self.in_use_bytes -= size
                    raise
                new += size
                with self._lock:
                    self.allocated_blocks += 1
            chunks.append(chunk)
        return chunks, new

    def _idle_block(self, size: int, pinned: bool) -> HostChunk | None:
        """An idle block of ``size``, else the smallest larger one (a tail fits in any block up to a chunk)."""
        while size <= CHUNK_BYTES:
            idle = self._idle.get((size, pinned))
            if idle:
                return idle.pop()
            size *= 2
        return None

    def give(self, chunks: list[HostChunk]) -> None:
        """Blocks back to the idle lists (a later user waits for their last copy's event)."""
        with self._lock:
            for chunk in chunks:
                size = chunk.buffer.numel()
                self._idle[(size, chunk.pinned)].append(chunk)
                self.in_use_bytes -= size
                self.idle_bytes += size

    def idle_chunks(self) -> list[HostChunk]:
        with self._lock:
            return [chunk for idle in self._idle.values() for chunk in idle]

    def release(self) -> int:
        """Free the idle blocks (and torch's cache of freed pinned memory); the bytes freed."""
        with self._lock:
            chunks = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            freed, self.idle_bytes = self.idle_bytes, 0
        for chunk in chunks:
            if chunk.event is not None:
                chunk.event.synchronize()  # its last copy is done before the block goes
        del chunks
        if torch.cuda.is_available():
            empty_host_cache = (getattr(torch.accelerator, "empty_host_cache", None)
                                or getattr(torch._C, "_host_emptyCache", None))
            if empty_host_cache is not None:
                empty_host_cache()
        logger.info("released %d bytes of idle activation-offload host memory", freed)
        return freed


POOL = PinnedPool()


def release_offload_buffers() -> int:
    """Free the idle host memory that activation offload keeps for reuse; returns the bytes freed.

    Blocks in use (saved inputs of a graph not yet run backward or dropped) stay. Reverting an offload patch
    calls this too.
    """
    return POOL.release()


class _Offloaded:
    """One saved tensor while it is away: its host blocks and, once brought back, its device copy."""

    __slots__ = ("position", "device", "dtype", "shape", "stride", "nbytes", "chunks", "back", "ready", "restored",
                 "__weakref__")

    def __init__(self, position: int, tensor: torch.Tensor, chunks: list[HostChunk]) -> None:
        self.position = position
        self.device, self.dtype = tensor.device, tensor.dtype
        self.shape, self.stride = tensor.shape, tensor.stride()
        self.nbytes = tensor.numel() * tensor.element_size()
        self.chunks = chunks
        self.back: torch.Tensor | None = None
        self.ready: Any = None  # CUDA event recorded after the copy back
        self.restored = False  # handed back once: never prefetched again (only a second backward reloads it)


class _Kept:
    """A kept layer's saved input (on the device as it was): unpacking it starts the prefetch before it."""

    __slots__ = ("position", "tensor", "__weakref__")

    def __init__(self, position: int, tensor: torch.Tensor) -> None:
        self.position = position
        self.tensor = tensor


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of the storage a tensor views (a parameter's or a view's of the hidden states alike); None for a
    tensor subclass without one of its own (a DTensor: never moved)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _spans(nbytes: int, chunks: list[HostChunk]) -> Iterator[tuple[int, int, HostChunk]]:
    offset = 0
    for chunk in chunks:
        length = min(chunk.buffer.numel(), nbytes - offset)
        yield offset, length, chunk
        offset += length


class ActivationOffloader:
    """The saved-tensor hooks of one decoder call, and the schedule of its layers' inputs (forward order).

    Entries are held weakly: an input's host blocks return to the pool as soon as autograd drops it.
    """

    def __init__(self, trace: Counter, pool: PinnedPool = POOL) -> None:
        self.trace = trace
        self.pool = pool
        self.layers: list[list[weakref.ref]] = []
        self.offloading: list[bool] = []
        self.inputs: list[set[int | None]] = []  # per layer: the storages of its positional inputs
        self.streams: dict[torch.device, Any] = {}

    @contextlib.contextmanager
    def layer(self, offload: bool, inputs: tuple = ()) -> Iterator[None]:
        """One checkpointed layer's call: what its checkpoint saves goes through ``pack`` / ``unpack``; of it, what
        views the storage of a tensor among ``inputs`` (the layer's positional inputs) moves if ``offload``."""
        self.layers.append([])
        self.offloading.append(offload)
        self.inputs.append({_storage(t) for t in inputs if isinstance(t, torch.Tensor)} - {None})
        self.trace[OFFLOAD_LAYERS if offload else OFFLOAD_KEPT] += 1
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.numel() == 0 or not self.layers:
            return tensor  # torch's placeholder input (an empty tensor) stays as it is
        position = len(self.layers) - 1
        if not self.offloading[position] or _storage(tensor) not in self.inputs[position]:
            kept = _Kept(position, tensor)
            self.layers[position].append(weakref.ref(kept))
            return kept
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()  # copied as its bytes; restored with the original strides
        flat = src.reshape(-1).view(torch.uint8)
        chunks, new = self.pool.take(flat.numel(), pinned=tensor.is_cuda)
        if tensor.is_cuda:
            side = self._side_stream(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            for chunk in chunks:
                if chunk.event is not None:
                    side.wait_event(chunk.event)  # the block's previous copy is done
            with torch.cuda.stream(side):
                for offset, length, chunk in _spans(flat.numel(), chunks):
                    chunk.buffer[:length].copy_(flat[offset:offset + length], non_blocking=True)
                event = side.record_event()
            src.record_stream(side)  # the device block is not reused before the copy is done
            for chunk in chunks:
                chunk.event = event
        else:
            for offset, length, chunk in _spans(flat.numel(), chunks):
                chunk.buffer[:length].copy_(flat[offset:offset + length])
        entry = _Offloaded(position, tensor, chunks)
        weakref.finalize(entry, self.pool.give, chunks)
        self.layers[position].append(weakref.ref(entry))
        self.trace[OFFLOAD_TENSORS] += 1
        self.trace[OFFLOAD_BYTES] += entry.nbytes
        self.trace[OFFLOAD_HOST_ALLOCATED] += new
        return entry

    def _entries(self, position: int) -> list[Any]:
        """The moved tensors of the layer at ``position`` still alive (not what stayed on the device beside them)."""
        return [e for e in (ref() for ref in self.layers[position]) if isinstance(e, _Offloaded)]

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Offloaded):
            for entry in self._entries(packed.position):
                self._bring_back(entry)
        if packed.position > 0 and self.offloading[packed.position - 1]:
            for entry in self._entries(packed.position - 1):  # backward reaches this layer next: start its copy
                if not entry.restored and self._bring_back(entry):
                    self.trace[OFFLOAD_PREFETCHED] += 1
        if isinstance(packed, _Kept):
            return packed.tensor
        tensor, packed.back, packed.restored = packed.back, None, True
        if packed.ready is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
            packed.ready = None
        if tensor.stride() != packed.stride:
            tensor = torch.empty_strided(packed.shape, packed.stride, dtype=packed.dtype,
                                         device=packed.device).copy_(tensor)
        self.trace[OFFLOAD_RESTORED] += 1
        return tensor

    def _bring_back(self, entry: _Offloaded) -> bool:
        """Start copying ``entry`` to its device unless under way; True if this call started it."""
        if entry.back is not None:
            return False
        back = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)  # for the compute stream
        if entry.device.type != "cuda":
            for offset, length, chunk in _spans(entry.nbytes, entry.chunks):
                back[offset:offset + length].copy_(chunk.buffer[:length])
        else:
            side = self._side_stream(entry.device)
            side.wait_stream(torch.cuda.current_stream(entry.device))  # the block may still be in use by queued work
            with torch.cuda.stream(side):
                for offset, length, chunk in _spans(entry.nbytes, entry.chunks):
                    back[offset:offset + length].copy_(chunk.buffer[:length], non_blocking=True)
                entry.ready = side.record_event()
            back.record_stream(side)
            for chunk in entry.chunks:
                chunk.event = entry.ready
        entry.back = back.view(entry.dtype).view(entry.shape)
        return True


class OffloadedCheckpoint:
    """A layer's checkpoint function run under the call's offload hooks (when gradients are recorded).

    An object holding the original function, the call's offloader and whether this layer's input moves (else it
    stays on the device), not a closure, and installed only for one forward.
    """

    def __init__(self, checkpoint_fn: Any, offloader: ActivationOffloader, offload: bool) -> None:
        self.checkpoint_fn = checkpoint_fn
        self.offloader = offloader
        self.offload = offload

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.checkpoint_fn(fn, *args, **kwargs)
        with self.offloader.layer(self.offload, args):
            return self.checkpoint_fn(fn, *args, **kwargs)


def check_offload_layers(value: Any, num_layers: int, model_name: str) -> int | str:
    """How many leading decoder layers ``offload_activations`` offloads (True: all, False: none, or an int), or
    ``"auto"``: those ``checkpointing="auto"`` fully checkpoints in each call."""
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, bool):
        return num_layers if value else 0
    if not isinstance(value, int):
        raise ValueError(f"offload_activations must be True, False, 'auto' or a number of decoder layers (int), got "
                         f"{value!r}")
    if not 1 <= value <= num_layers:
        raise ValueError(f"offload_activations={value} must count between 1 and {num_layers} decoder layers (the "
                         f"first K layers' inputs are offloaded; {model_name} has {num_layers}); pass True for all "
                         "of them or False for none")
    return value


def leading_full_layers(modes: list[str]) -> int:
    """How many of the first layers a call's plan fully checkpoints: what ``offload_activations="auto"`` moves."""
    return next((i for i, mode in enumerate(modes) if mode != "full"), len(modes))


def check_checkpointed(layers: Any, model_name: str) -> None:
    """Refuse layers that are not all checkpointed by torch's non-reentrant checkpoint (what offload hooks)."""
    for i, layer in enumerate(layers):
        fn = layer.__dict__.get("_gradient_checkpointing_func")
        if not getattr(layer, "gradient_checkpointing", False) or fn is None:
            raise ValueError(
                f"offload_activations moves the layer inputs that gradient checkpointing keeps, but decoder layer "
                f"{i} of {model_name} is not checkpointed; enable it on every layer first: {_ENABLE_HINT}")
        if isinstance(fn, (OffloadedCheckpoint, InGraphCheckpoint)):
            continue
        if not (isinstance(fn, functools.partial) and fn.func is torch.utils.checkpoint.checkpoint
                and fn.keywords.get("use_reentrant") is False):
            raise ValueError(
                f"offload_activations needs torch's non-reentrant checkpoint (use_reentrant=False) as decoder layer "
                f"{i}'s _gradient_checkpointing_func, found {fn!r}; enable it with {_ENABLE_HINT} (and without "
                "transformers' own offload=True, which copies on the compute stream)")


@contextlib.contextmanager
def offloaded_layers(layers: Any, trace: Counter, model_name: str,
                     offload_layers: int) -> Iterator[ActivationOffloader]:
    """Wrap every layer's checkpoint function with an ``OffloadedCheckpoint`` for one forward; the first
    ``offload_layers`` offload their input, the others keep it (and start the prefetch of the last offloaded)."""
    check_checkpointed(layers, model_name)
    offloader = ActivationOffloader(trace)
    originals = [layer.__dict__["_gradient_checkpointing_func"] for layer in layers]
    try:
        for i, (layer, original) in enumerate(zip(layers, originals)):
            wrapped = OffloadedCheckpoint(original, offloader, offload=i < offload_layers)
            layer.__dict__["_gradient_checkpointing_func"] = wrapped
        yield offloader
    finally:
        for layer, original in zip(layers, originals):
            layer.__dict__["_gradient_checkpointing_func"] = original


class OffloadActivations(FeatureOption):
    """``offload_activations``: True (every layer), False, K (the first K layers) or ``"auto"``; its value: K or
    ``"auto"``."""

    name = "offload_activations"
    keywords = {"offload_activations": False}
    off_value = 0
    needs = ("checkpointing",)
    doc = ("in every training call the checkpointed decoder layers' inputs wait in pinned CPU memory until backward "
           "(copies on a side stream, prefetched one layer ahead; bitwise the same results). An int K offloads only "
           "the first K layers' inputs (host memory: K x tokens x hidden x dtype bytes per call); ``'auto'`` (with "
           "``checkpointing='auto'``) offloads, in each call, the layers its plan fully checkpoints, and the plan "
           "counts their inputs off the GPU, so the budget keeps more layers. Needs the layers checkpointed: by "
           "``checkpointing=`` or by the model's own non-reentrant gradient checkpointing.")

    def resolve(self, asked: Any, facts: PlanFacts, decided: Any) -> Any:
        layers = check_offload_layers(asked["offload_activations"], len(facts.parts.layers), facts.model_name)
        if not layers:
            return self.decision(asked, 0, "not asked")
        checkpointing = decided["checkpointing"].value
        if layers == "auto":
            if checkpointing is None or checkpointing.mode != "auto":
                raise ValueError(
                    "offload_activations='auto' offloads the layers that checkpointing='auto' fully checkpoints in "
                    f"each call, but checkpointing={checkpointing.mode if checkpointing else None!r}; pass "
                    "checkpointing='auto' with memory_budget_gib, or offload_activations=True / K (the first K "
                    "layers)")
            return self.decision(asked, "auto", "in each training call, the layers checkpointing='auto' fully "
                                 "checkpoints (the leading ones) offload their inputs to pinned host memory until "
                                 "backward; the plan counts those inputs off the GPU",
                                 range(len(facts.parts.layers)))
        if checkpointing is None:
            check_checkpointed(facts.parts.layers, facts.model_name)
            how = "the model's own non-reentrant checkpoint"
        else:
            how = f"checkpointing={checkpointing.mode!r}"
        return self.decision(asked, layers, f"the first {layers} layers' checkpointed inputs ({how}) wait in pinned "
                             "host memory until backward", range(layers))


class ActivationOffload(DecoderFeature):
    """``patch_model(offload_activations=...)``: every training call (gradients recorded, else nothing is
    checkpointed) runs the checkpointed layers under the offload hooks; ``check`` requires every layer to have run
    under them and every offloaded layer to have moved its input. Entered before the attention features, whose
    wrappers of the checkpoint functions (for the recomputation) then run inside the offload's."""

    name = "activation_offload"
    options = (OffloadActivations(),)
    after = ("checkpointing",)

    def install(self, handle: Any) -> None:
        if handle.state.value("offload_activations"):
            handle.add_undo(release_offload_buffers)

    def active(self, call: DecoderCall) -> bool:
        return call.patch is not None and bool(call.patch.value("offload_activations")) and torch.is_grad_enabled()

    def enter(self, call: DecoderCall) -> contextlib.AbstractContextManager:
        # Only the layers checkpointed in this call: the planned checkpointing keeps no compiled layer of the first K
        # (the offloaded ones) whole, but may keep some of the others.
        layers = call.checkpointed_layers
        return offloaded_layers(layers, call.trace, call.model_name, self._offloaded(call))

    def _asked(self, call: DecoderCall) -> int:
        """How many of the first layers this call offloads: K, or under ``"auto"`` those its plan fully
        checkpoints."""
        asked = call.patch.value("offload_activations")
        return leading_full_layers(call.checkpoint_modes or []) if asked == "auto" else asked

    def _offloaded(self, call: DecoderCall) -> int:
        """How many of the call's checkpointed layers offload: the first K of the decoder's layers, all checkpointed
        (the planned checkpointing keeps none of them whole)."""
        first = call.parts.layers[:self._asked(call)]
        checkpointed = {id(layer) for layer in call.checkpointed_layers}
        return sum(id(layer) in checkpointed for layer in first)

    def check(self, call: DecoderCall) -> None:
        layers = len(call.checkpointed_layers)
        offload, asked = self._offloaded(call), self._asked(call)
        ran, kept, tensors = call.ran(OFFLOAD_LAYERS), call.ran(OFFLOAD_KEPT), call.ran(OFFLOAD_TENSORS)
        if offload < asked:
            raise PatchNotAppliedError(
                f"activation offload: only {offload} of the first {asked} decoder layers of {call.model_name} were "
                "checkpointed in this call, so the others had no input to offload; refusing to continue without the "
                "offload that was asked for")
        if ran < offload or ran + kept < layers:
            raise PatchNotAppliedError(
                f"activation offload ran in {ran + kept} of {layers} decoder layers of {call.model_name} ({ran} of "
                f"the {offload} to offload): their checkpoint did not run (transformers checkpoints only in training "
                f"mode: call model.train(); model.training={call.model.training}) or the installed transformers "
                "bypassed the layers' _gradient_checkpointing_func; refusing to continue without the offload that "
                "was asked for")
        if tensors < offload:
            raise PatchNotAppliedError(
                f"activation offload moved {tensors} tensors for {offload} offloaded layers: the installed torch "
                "checkpoint saved its inputs without the saved-tensor hooks in force; actorcore must be updated")
