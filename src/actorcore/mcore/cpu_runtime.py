"""Run megatron-core 0.16.x on a CPU-only torch (gloo): shims applied inside a context manager, undone on exit.

megatron-core assumes CUDA in places that matter even when nothing runs on a GPU. Each shim answers one
measured failure of 0.16.1 on the CPU (shared NOTES.md): it asks ``torch.cuda`` for the current device,
synchronises, opens CUDA streams and events and records tensors on them, marks NVTX ranges (the combined 1F1B
schedule of ``overlap_moe_expert_parallel_comm``), moves the tied embedding with ``.cuda()``,
builds a few tensors on ``device="cuda"`` in the pipeline schedule; its MoE router references
TransformerEngine's ``te_general_gemm`` when TE is absent; the all-to-all token dispatcher keeps its split
sizes as tensors when they are already on the CPU; MLA trusts a TE check that is wrong without TE; and the
checkpoint writer's worker needs ``psutil``, which megatron-core does not declare.

``with CpuRuntime(): ...`` installs them (process-wide: they patch ``torch.cuda``, ``torch.Tensor`` and
megatron modules) and restores every patched attribute to the very object it replaced when the block
exits, exceptions included. Nothing is applied on import and nothing is kept at module level: the
``CpuRuntime`` object holds what it replaced. On a machine with CUDA it does nothing. The shims were
written against megatron-core 0.16.x and each one depends on its internals, so another version is refused
(``UnsupportedMegatronVersionError``) rather than half-patched.

Re-entrant: entering the same object again only counts the depth; a second ``CpuRuntime`` entered inside a
first finds the first one's mark on ``torch.cuda.current_device``, applies nothing and restores nothing.
Exit nested blocks in reverse order (as ``with`` does).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import types
from typing import Any, Callable

import torch
from actorcore.errors import UnsupportedMegatronVersionError  # noqa: F401 (re-exported)

SUPPORTED_MEGATRON = "0.16"  # major.minor the shims were written and tested for
_MISSING = object()


def installed_megatron_version() -> str:
    return importlib.metadata.version("megatron-core")


def check_megatron_version(version: str) -> None:
    """Refuse a megatron-core whose major.minor is not ``SUPPORTED_MEGATRON``."""
    if ".".join(version.split(".")[:2]) != SUPPORTED_MEGATRON:
        raise UnsupportedMegatronVersionError(
            f"actorcore's CPU runtime for megatron-core was written for {SUPPORTED_MEGATRON}.x, but megatron-core "
            f"{version} is installed: run the Megatron route on a CUDA machine, or install "
            f"'megatron-core>={SUPPORTED_MEGATRON},<0.{int(SUPPORTED_MEGATRON.split('.')[1]) + 1}' for CPU runs")


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` on the CPU: work is synchronous, so waiting is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> "_NullEvent":
        return _NullEvent()  # already complete


class _NullEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU (the combined 1F1B schedule's nodes record and wait on
    events between their streams): work is synchronous, so every event is complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


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


def _move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    # On the GPU the all-to-all split sizes become host lists here; CPU tensors would stay tensors,
    # which all_to_all_single rejects as split sizes.
    return tensor.tolist() if as_numpy and torch.is_tensor(tensor) else tensor


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


# The mark of an active runtime: a nested ``CpuRuntime`` that finds it applies (and later restores) nothing.
_cpu_current_device.actorcore_cpu_runtime = True  # type: ignore[attr-defined]


def _shims() -> list[tuple[Any, str, Callable[[], Any]]]:
    """(target object, attribute, factory of the replacement) for every shim this megatron-core needs."""
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    shims: list[tuple[Any, str, Callable[[], Any]]] = [
        (torch.cuda, "current_device", lambda: _cpu_current_device),
        (torch.cuda, "synchronize", lambda: lambda *a, **k: None),
        (torch.cuda, "Stream", lambda: _NullStream),
        (torch.cuda, "current_stream", lambda: lambda *a, **k: _NullStream()),
        (torch.cuda, "stream", lambda: lambda *a, **k: contextlib.nullcontext()),
        (torch.cuda, "Event", lambda: _NullEvent),
        # The combined 1F1B schedule's nodes mark their ranges for the profiler (NVTX is CUDA-only).
        (torch.cuda.nvtx, "range_push", lambda: lambda *a, **k: None),
        (torch.cuda.nvtx, "range_pop", lambda: lambda *a, **k: None),
        (torch.Tensor, "record_stream", lambda: lambda self, *a, **k: None),
        # Tied embeddings across pipeline stages: LanguageModule moves the shared weight with ``.cuda()``.
        (torch.Tensor, "cuda", lambda: lambda self, *a, **k: self),
        # 0.16.1 references TE's GEMM in the MoE router when TE is absent.
        (moe_utils, "te_general_gemm", lambda: None),
        (token_dispatcher, "maybe_move_tensor_to_cpu", lambda: _move_to_cpu),
        (schedules, "torch", lambda: _cpu_device_torch(torch)),
    ]
    if not filesystem_async.HAVE_PSUTIL:
        # The checkpoint writer's worker only logs its memory use with psutil; without it the forked worker
        # dies and the save waits forever.
        shims.append((filesystem_async, "_process_memory", lambda: lambda: 0))
    return shims


def _own(obj: Any, name: str) -> Any:
    """The attribute as stored on ``obj`` itself (``_MISSING`` if inherited or absent)."""
    return vars(obj).get(name, _MISSING)


class CpuRuntime:
    """Context manager: megatron-core's CPU shims for the duration of the block (no-op with CUDA).

    ``replaced`` lists ``(target, attribute, original)`` for what this object changed while it is active.
    """

    def __init__(self) -> None:
        self.replaced: list[tuple[Any, str, Any]] = []
        self._depth = 0

    def __enter__(self) -> "CpuRuntime":
        if self._depth == 0 and not torch.cuda.is_available():
            self._apply()
        self._depth += 1
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._restore()

    def _apply(self) -> None:
        from actorcore.mcore._megatron import require_megatron

        require_megatron()
        check_megatron_version(installed_megatron_version())
        if getattr(torch.cuda.current_device, "actorcore_cpu_runtime", False):
            return  # an enclosing CpuRuntime is active; it restores everything when it exits
        shims = _shims()  # imports first: nothing is patched if a target module is missing
        try:
            for obj, name, make in shims:
                self.replaced.append((obj, name, _own(obj, name)))
                setattr(obj, name, make())
        except BaseException:
            self._restore()
            raise

    def _restore(self) -> None:
        while self.replaced:
            obj, name, original = self.replaced.pop()
            if original is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, original)


@contextlib.contextmanager
def te_absent_fixes():
    """megatron-core 0.16.x without TransformerEngine, on any device (CUDA too), for the block, then undone:
    - its MoE router tests an undefined ``te_general_gemm`` (a NameError on the first MoE forward): defined as
      ``None`` (the no-TE branch);
    - MLA's constructor sets ``HAVE_TE`` when TE's extension module imports with placeholder classes, then calls
      ``isinstance(..., <placeholder>)`` (a TypeError building DeepSeek-V3 on a GPU without TE): ``HAVE_TE = False``.
    Nothing is changed where the names are already right."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as multi_latent_attention

    fixes = []
    if not hasattr(moe_utils, "te_general_gemm"):
        fixes.append((moe_utils, "te_general_gemm", None))
    if multi_latent_attention.HAVE_TE and not isinstance(multi_latent_attention.TELinear, type):
        fixes.append((multi_latent_attention, "HAVE_TE", False))
    applied = []
    try:
        for module, name, value in fixes:
            applied.append((module, name, _own(module, name)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, original in reversed(applied):
            if original is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, original)
