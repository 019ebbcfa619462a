"""Test-only shims that let megatron-core 0.16.1 run on a CPU-only torch with gloo.

Never applied by library code: tests (and the CPU conversion CLI path, which calls ``apply`` explicitly
when CUDA is absent) opt in with ``with cpu_shims(): ...`` or ``apply()``. Each shim answers one measured
failure (see shared NOTES.md): megatron asks ``torch.cuda`` for the current device, synchronises, opens
CUDA streams, moves the tied embedding with ``.cuda()``, builds a few tensors on ``device="cuda"`` in the pipeline schedule, and its MoE router
references TransformerEngine's ``te_general_gemm`` when TE is absent (0.16.1 bug), and the all-to-all token
dispatcher keeps its split sizes as tensors when they are already on the CPU.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

import torch


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` on the CPU: work is synchronous, so waiting is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> "_NullStream":
        return self  # an "event" that is already complete: synchronize() is a no-op


def _cpu_device_torch(real: types.ModuleType) -> types.SimpleNamespace:
    """A ``torch`` lookalike whose tensor factories map ``device="cuda"`` to the CPU."""

    def remap(fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return wrapper

    proxy = types.SimpleNamespace()
    for name in dir(real):
        if not name.startswith("__"):
            try:
                setattr(proxy, name, getattr(real, name))
            except Exception:  # noqa: BLE001 - lazily failing attributes are simply skipped
                pass
    for name in ("zeros", "ones", "empty", "tensor", "full", "arange"):
        setattr(proxy, name, remap(getattr(real, name)))
    return proxy


_applied: list[tuple[Any, str, Any]] = []


def _set(obj: Any, name: str, value: Any) -> None:
    _applied.append((obj, name, getattr(obj, name, None)))
    setattr(obj, name, value)


def apply() -> None:
    """Install the shims (idempotent). ``revert()`` undoes them."""
    if _applied or torch.cuda.is_available():
        return
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.transformer.multi_latent_attention as multi_latent_attention
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # On the GPU the all-to-all split sizes become host lists here; CPU tensors would stay tensors,
        # which all_to_all_single rejects as split sizes.
        return tensor.tolist() if as_numpy and torch.is_tensor(tensor) else tensor

    _set(torch.cuda, "current_device", lambda: torch.device("cpu"))
    _set(torch.cuda, "synchronize", lambda *a, **k: None)
    _set(torch.cuda, "Stream", _NullStream)
    _set(torch.cuda, "current_stream", lambda *a, **k: _NullStream())
    _set(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _set(torch.Tensor, "record_stream", lambda self, *a, **k: None)
    # Tied embeddings across pipeline stages: LanguageModule moves the shared weight with ``.cuda()``.
    _set(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _set(moe_utils, "te_general_gemm", None)
    _set(token_dispatcher, "maybe_move_tensor_to_cpu", move_to_cpu)
    _set(schedules, "torch", _cpu_device_torch(torch))
    if not isinstance(multi_latent_attention.TELinear, type):
        # Without TE, 0.16.1's TE extension module still imports (with placeholder classes), so MLA sets
        # HAVE_TE and calls isinstance(..., <placeholder>).
        _set(multi_latent_attention, "HAVE_TE", False)
    if not filesystem_async.HAVE_PSUTIL:
        # The checkpoint writer's worker only logs its memory use with psutil (an undeclared dependency of
        # megatron-core 0.16.1); without it the forked worker dies and the save waits forever.
        _set(filesystem_async, "_process_memory", lambda: 0)


def revert() -> None:
    while _applied:
        obj, name, old = _applied.pop()
        setattr(obj, name, old)


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    already = bool(_applied)
    apply()
    try:
        yield
    finally:
        if not already:
            revert()
