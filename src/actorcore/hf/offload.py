"""Activation offload: the inputs that gradient checkpointing keeps wait in pinned CPU memory until backward.

Why: with gradient checkpointing each decoder layer keeps only its input hidden states until backward, but at
long length those fill the GPU (Llama-8B in bf16: 8 KiB per token per layer, 128 GiB at 512K tokens over 32
layers). Here they live in pinned host memory instead, and the copies run on a side CUDA stream so they hide
behind the layers' compute.

How, for one decoder call (``offloaded_layers``): each decoder layer's ``_gradient_checkpointing_func`` (the
per-layer checkpoint function transformers calls as ``func(partial(forward, **kwargs), *args)``: torch's
non-reentrant ``checkpoint``) is wrapped by an ``OffloadedCheckpoint`` that runs it inside the
``saved_tensors_hooks`` of the call's ``ActivationOffloader``. Non-reentrant checkpoint saves its positional
inputs through the hooks in force (ours) and only then installs its own hooks for the layer's body, so exactly
the checkpointed inputs (the hidden states) move; whatever the layer saves inside is the checkpoint's business.

- pack (forward): the side stream waits for the compute stream, copies the tensor into pinned CPU memory
  without blocking, and ``record_stream`` keeps its device block from reuse until the copy is done; the device
  tensor is released at once.
- unpack (backward, when the checkpoint recomputes a layer): that layer's input comes back (unless it was
  prefetched) and the input of the layer before it, the next one backward reaches, is prefetched; both copies
  run on the side stream into memory allocated on the compute stream, which waits only for its own tensor.
- Not CUDA: the copy is synchronous; on the CPU it is a copy in CPU memory (the mechanics, tested there).

Exact: the recomputation reads the same bits with the same shape, strides and dtype; nothing else changes.
The wrappers live for one forward (the unpack hooks travel with the saved tensors into backward), and hold
the call's offloader, never a module, so nothing stays installed on the model.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any, Iterator

import torch
import torch.utils.checkpoint

# Trace keys, counted per call: layers run under the offload hooks, tensors moved out and their bytes,
# tensors brought back, and how many of those were prefetched ahead of their layer's recompute.
OFFLOAD_LAYERS = "offload:layers"
OFFLOAD_TENSORS = "offload:tensors"
OFFLOAD_BYTES = "offload:bytes"
OFFLOAD_RESTORED = "offload:restored"
OFFLOAD_PREFETCHED = "offload:prefetched"

_ENABLE_HINT = ("model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) "
                "(transformers >= 5.24: activation_checkpointing_enable(activation_checkpointing_kwargs="
                "{'use_reentrant': False}))")


class _Offloaded:
    """One saved tensor while it is away: its CPU copy and, once brought back, its device copy."""

    __slots__ = ("position", "device", "cpu", "back", "ready", "restored")

    def __init__(self, position: int, device: torch.device, cpu: torch.Tensor) -> None:
        self.position = position
        self.device = device
        self.cpu = cpu
        self.back: torch.Tensor | None = None
        self.ready: Any = None  # CUDA event recorded after the copy back
        self.restored = False  # handed back once: never prefetched again (only a second backward reloads it)


class ActivationOffloader:
    """The saved-tensor hooks of one decoder call, and the schedule of its layers' inputs (forward order)."""

    def __init__(self, trace: Counter) -> None:
        self.trace = trace
        self.layers: list[list[_Offloaded]] = []
        self.streams: dict[torch.device, Any] = {}

    @contextlib.contextmanager
    def layer(self) -> Iterator[None]:
        """One checkpointed layer's call: what its checkpoint saves goes through ``pack`` / ``unpack``."""
        self.layers.append([])
        self.trace[OFFLOAD_LAYERS] += 1
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.numel() == 0 or not self.layers:
            return tensor  # torch's placeholder input (an empty tensor) stays as it is
        if tensor.is_cuda:
            side = self._side_stream(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            cpu = torch.empty_like(tensor, device="cpu", pin_memory=True)
            with torch.cuda.stream(side):
                cpu.copy_(tensor.detach(), non_blocking=True)
            tensor.record_stream(side)  # the device block is not reused before the copy is done
        else:
            cpu = tensor.detach().to("cpu", copy=True)
        entry = _Offloaded(len(self.layers) - 1, tensor.device, cpu)
        self.layers[-1].append(entry)
        self.trace[OFFLOAD_TENSORS] += 1
        self.trace[OFFLOAD_BYTES] += tensor.numel() * tensor.element_size()
        return entry

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        for entry in self.layers[packed.position]:
            self._bring_back(entry)
        if packed.position > 0:  # backward reaches the layer before next: start its copy now
            for entry in self.layers[packed.position - 1]:
                if not entry.restored and self._bring_back(entry):
                    self.trace[OFFLOAD_PREFETCHED] += 1
        tensor, packed.back, packed.restored = packed.back, None, True
        if packed.ready is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.ready)
            packed.ready = None
        self.trace[OFFLOAD_RESTORED] += 1
        return tensor

    def _bring_back(self, entry: _Offloaded) -> bool:
        """Start copying ``entry`` to its device unless under way; True if this call started it."""
        if entry.back is not None:
            return False
        if entry.device.type != "cuda":
            entry.back = entry.cpu.to(entry.device, copy=True)
            return True
        compute = torch.cuda.current_stream(entry.device)
        side = self._side_stream(entry.device)
        back = torch.empty_like(entry.cpu, device=entry.device)  # allocated for the compute stream
        side.wait_stream(compute)  # that block may still be in use by queued compute work
        with torch.cuda.stream(side):
            back.copy_(entry.cpu, non_blocking=True)
            entry.ready = side.record_event()
        back.record_stream(side)
        entry.back = back
        return True


class OffloadedCheckpoint:
    """A layer's checkpoint function run under the call's offload hooks (when gradients are recorded).

    An object holding the original function and the call's offloader, not a closure, and installed only for
    one forward.
    """

    def __init__(self, checkpoint_fn: Any, offloader: ActivationOffloader) -> None:
        self.checkpoint_fn = checkpoint_fn
        self.offloader = offloader

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.checkpoint_fn(fn, *args, **kwargs)
        with self.offloader.layer():
            return self.checkpoint_fn(fn, *args, **kwargs)


def check_checkpointed(layers: Any, model_name: str) -> None:
    """Refuse layers that are not all checkpointed by torch's non-reentrant checkpoint (what offload hooks)."""
    for i, layer in enumerate(layers):
        fn = layer.__dict__.get("_gradient_checkpointing_func")
        if not getattr(layer, "gradient_checkpointing", False) or fn is None:
            raise ValueError(
                f"offload_activations moves the layer inputs that gradient checkpointing keeps, but decoder layer "
                f"{i} of {model_name} is not checkpointed; enable it on every layer first: {_ENABLE_HINT}")
        if isinstance(fn, OffloadedCheckpoint):
            continue
        if not (isinstance(fn, functools.partial) and fn.func is torch.utils.checkpoint.checkpoint
                and fn.keywords.get("use_reentrant") is False):
            raise ValueError(
                f"offload_activations needs torch's non-reentrant checkpoint (use_reentrant=False) as decoder layer "
                f"{i}'s _gradient_checkpointing_func, found {fn!r}; enable it with {_ENABLE_HINT} (and without "
                "transformers' own offload=True, which copies on the compute stream)")


@contextlib.contextmanager
def offloaded_layers(layers: Any, trace: Counter, model_name: str) -> Iterator[ActivationOffloader]:
    """Wrap every layer's checkpoint function with an ``OffloadedCheckpoint`` for one forward."""
    check_checkpointed(layers, model_name)
    offloader = ActivationOffloader(trace)
    originals = [layer.__dict__["_gradient_checkpointing_func"] for layer in layers]
    try:
        for layer, original in zip(layers, originals):
            layer.__dict__["_gradient_checkpointing_func"] = OffloadedCheckpoint(original, offloader)
        yield offloader
    finally:
        for layer, original in zip(layers, originals):
            layer.__dict__["_gradient_checkpointing_func"] = original
