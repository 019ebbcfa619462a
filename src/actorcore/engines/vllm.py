"""``VllmBridge``: the trainer's weights into a vLLM engine, exactly, or an error.

One ``bridge.update(stream, reference=model)`` per weight sync does everything the installed vLLM needs
(``actorcore.engines.vllm_worker``: its reload protocol, the post-processing it skips on an update, an account of
every layer), resets the prefix cache, and verifies that the engine now computes with the trainer's weights: the
engine's log-probs of a fixed probe sequence, and of tokens it generates after that probe (which reads the prefix
cache), against the trainer's own, per token. Anything partial, stale or different raises ``EngineUpdateError``
and leaves the engine refusing to generate until an update succeeds.

Both layouts users run vLLM in:

- colocated: the ``LLM`` in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the hybrid-engine layout);
  the stream is loaded directly, nothing is copied.
- a separate engine process (vLLM's default): start it with
  ``LLM(..., worker_extension_cls=actorcore.engines.WORKER_EXTENSION)``; the stream travels over actorcore's IPC
  transport (``transport="ipc"``: shared memory, one worker) or a process group joining the trainer and every
  worker (``transport="group"`` after ``bridge.connect_group(...)``: ``broadcast_stream``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from actorcore.batch import PackedBatch
from actorcore.buckets import Bucket
import actorcore.engines.vllm_worker as vllm_worker
from actorcore.engines.probe import ProbeResult, compare_probe, probe_tokens
from actorcore.errors import EngineUpdateError
from actorcore.sizes import positive_size

logger = logging.getLogger(__name__)

TRANSPORTS = ("ipc", "group")
_LOGIT_MODES = ("raw_logits", "processed_logits")


@dataclass
class EngineUpdate:
    """What one ``bridge.update`` did: tensors and bytes delivered, the engine's account, the probe's agreement."""

    tensors: int
    bytes: int
    probe: ProbeResult
    load_seconds: float
    verify_seconds: float
    reprocessed_shared: list[str] = field(default_factory=list)  # modules processed again for a tied weight
    experts_repacked: list[str] = field(default_factory=list)  # experts layers whose repacking ran again


class VllmBridge:
    """Weight updates of one vLLM ``LLM`` (in this process or an engine process), exact or loud.

    - ``tolerance``: ``(max_abs, mean_abs)`` in nats for the probe's per-token log-probs against the trainer's;
      by default from the engine's dtype (``probe.DEFAULT_TOLERANCE``: exact within float32 rounding in float32;
      in 16-bit the kernels of two implementations differ, so the probe catches stale and broken layers, and an
      engine whose outputs did not move when the trainer's did, not sub-rounding drift).
    - ``transport``: for an engine in another process, ``"ipc"`` (shared memory; the engine has one worker) or
      ``"group"`` (``broadcast_stream`` over the group of ``connect_group``).
    - ``reset_running_requests``: the prefix cache can only be reset while no request holds KV blocks; by default an
      update with requests in flight is an error (their KV is from the old weights), ``True`` preempts them.
    - ``probe_length`` / ``generated``: the probe's prompt tokens (by default two KV-cache blocks and a bit, so a
      stale prefix cache is read) and the tokens generated after it.
    """

    def __init__(self, llm: Any, *, tolerance: tuple[float, float] | None = None, transport: str = "ipc",
                 reset_running_requests: bool = False, probe_length: int | None = None, generated: int = 4,
                 seed: int = 0, timeout: float | None = None):
        vllm_worker.check_vllm_version()
        if not callable(getattr(llm, "generate", None)) or getattr(llm, "llm_engine", None) is None:
            raise ValueError(f"VllmBridge needs a vllm.LLM, got {type(llm).__name__}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.llm = llm
        self.transport = transport
        self.reset_running_requests = bool(reset_running_requests)
        self.timeout = None if timeout is None else positive_size("timeout", timeout, unit="seconds", integer=False,
                                                                  hint="pass seconds, or None to wait while the "
                                                                       "engine's process runs")
        config = llm.llm_engine.model_config
        if str(getattr(config, "logprobs_mode", "raw_logprobs")) in _LOGIT_MODES:
            raise ValueError(f"the engine reports logits (logprobs_mode={config.logprobs_mode!r}); the bridge verifies "
                             "updates through the engine's log-probs: start it with logprobs_mode='raw_logprobs' "
                             "(the default) or 'processed_logprobs'")
        self.engine_dtype: torch.dtype = config.dtype
        self.hf_config = config.hf_config
        self.tolerance = tolerance
        self._worker = _worker_in_process(llm)
        if self._worker is None:
            self._check_extension()
        block_size = int(getattr(llm.llm_engine.vllm_config.cache_config, "block_size", 16) or 16)
        limit = int(config.max_model_len) - generated - 1
        length = probe_length if probe_length is not None else min(2 * block_size + 5, limit)
        if isinstance(length, bool) or not isinstance(length, int) or not isinstance(generated, int) \
                or not 2 <= length <= limit or generated < 0:
            raise ValueError(f"probe_length must be in [2, max_model_len - generated - 1 = {limit}] and generated "
                             f">= 0, got {probe_length} and {generated}")
        self.generated = generated
        self.probe_batch: PackedBatch = probe_tokens(_vocab_size(self.hf_config), length, seed)
        self._group: Any = None
        self._last: ProbeResult | None = None
        self.updates = 0

    # -- where the engine is --

    @property
    def colocated(self) -> bool:
        return self._worker is not None

    def _rpc(self, method: str, **kwargs: Any) -> list[Any]:
        return self.llm.collective_rpc(method, kwargs=kwargs)

    def _check_extension(self) -> None:
        try:
            answers = self._rpc("actorcore_protocol")
        except Exception as exc:  # noqa: BLE001 - re-raised with what to do
            raise ValueError("this vLLM engine runs in another process without actorcore's worker extension: "
                             f"start it with LLM(..., worker_extension_cls={vllm_worker.WORKER_EXTENSION!r}) ({exc})"
                             ) from exc
        for answer in answers:
            if answer.get("protocol") != vllm_worker.PROTOCOL:
                raise ValueError(f"the engine's actorcore worker extension speaks protocol {answer.get('protocol')}, "
                                 f"this actorcore {vllm_worker.PROTOCOL}: use the same actorcore in both processes")
        if self.transport == "ipc" and len(answers) != 1:
            raise ValueError(f"the IPC transport feeds one worker and this engine has {len(answers)}: use "
                             "transport='group' with bridge.connect_group(...)")

    def connect_group(self, host: str = "127.0.0.1", port: int | None = None, *, backend: str = "gloo",
                      timeout_s: float = 300.0) -> Any:
        """Form the weight-sync process group of this process (rank 0) and every engine worker (ranks 1..n) for
        ``transport="group"``; returns the group (``backend``: ``"gloo"``, or ``"nccl"`` with CUDA tensors)."""
        from datetime import timedelta

        import torch.distributed as dist

        if self.colocated:
            raise ValueError("a colocated engine reads the stream directly; a process group is for an engine in "
                             "another process")
        workers = len(self._rpc("actorcore_protocol"))
        port = _free_port() if port is None else int(port)
        store = dist.TCPStore(host, port, workers + 1, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        joining = _InThread(lambda: self._rpc("actorcore_join_group", host=host, port=port, world_size=workers + 1,
                                              backend=backend, timeout_s=timeout_s))
        self._group = vllm_worker._standalone_group(backend, store, 0, workers + 1)
        joining.result()
        self._store = store  # alive as long as the group
        self.transport = "group"
        return self._group

    # -- the update --

    def update(self, stream: Iterable[Bucket], *, reference: Any) -> EngineUpdate:
        """Load ``stream`` (checkpoint-named buckets: ``hf_weight_stream(model)``, ``mcore_weight_stream(model)``)
        into the engine, reset its prefix cache, and verify it against ``reference``: the trainer's model (an HF
        model, scored in eval mode as the engine computes, without dropout; or an ``McoreModel``), a function
        ``PackedBatch -> log-probs [T]``, or a tensor holding the trainer's log-probs of ``bridge.probe_batch`` (what
        a multi-rank trainer computes on every rank, then passes on the rank that holds the engine; it verifies the
        probe's prompt only). Returns an ``EngineUpdate``.

        Raises ``EngineUpdateError`` (the engine is then blocked until an update succeeds) when the stream did not
        reach every layer, the prefix cache could not be reset, or the engine's probe log-probs differ from the
        trainer's; errors of the stream itself (a wrong shape, a dead sender) propagate, the engine blocked too.
        """
        _reference_function(reference, self.probe_batch)  # an unusable reference: refused before anything moves
        _check_same_model(reference, self.hf_config)  # before the engine is touched
        start = time.perf_counter()
        was_blocked = self.blocked is not None
        try:
            report = self._deliver(stream)
        except Exception as exc:
            raise EngineUpdateError(f"the weight update did not complete, and the engine is blocked until one "
                                    f"does: {type(exc).__name__}: {exc}") from exc
        loaded = time.perf_counter()
        if self.llm.llm_engine is not None and callable(getattr(self.llm.llm_engine, "reset_encoder_cache", None)):
            self.llm.llm_engine.reset_encoder_cache()
        if was_blocked:
            self._abort_unfinished()  # requests that ran into the blocked engine: nothing of them can be kept
        if not self.llm.reset_prefix_cache(reset_running_requests=self.reset_running_requests):
            self._block("the prefix cache could not be reset (requests in flight hold KV blocks of the old weights)")
            raise EngineUpdateError("the weights were loaded but vLLM could not reset its prefix cache: requests in "
                                    "flight hold KV blocks computed with the old weights. Update between generate "
                                    "calls, or pass reset_running_requests=True to preempt them")
        probe = self.verify(reference)
        self.updates += 1
        if callable(getattr(self.llm.llm_engine, "set_weight_version", None)):
            self.llm.llm_engine.set_weight_version(f"actorcore-{self.updates}")
        return EngineUpdate(tensors=report["tensors"], bytes=report["bytes"], probe=probe,
                            load_seconds=loaded - start, verify_seconds=time.perf_counter() - loaded,
                            reprocessed_shared=list(report.get("reprocessed_shared", ())),
                            experts_repacked=list(report.get("experts_repacked", ())))

    def verify(self, reference: Any) -> ProbeResult:
        """Compare the engine's log-probs on the probe with ``reference``'s (see ``update``); raise
        ``EngineUpdateError`` and block the engine when they differ beyond the tolerance, or when the engine's
        did not move while the trainer's did."""
        reference_fn = _reference_function(reference, self.probe_batch)
        engine = self._engine_probe(with_generation=not isinstance(reference, torch.Tensor))
        result = compare_probe(engine, reference_fn, self.engine_dtype, self.tolerance, previous=self._last)
        if not result.ok:
            self._block(f"probe verification failed: {result.reason}")
            raise EngineUpdateError(f"the engine does not compute with the trainer's weights: {result.reason}. The "
                                    "engine is blocked until an update succeeds")
        self._last = result
        logger.info("vLLM engine verified: probe max |dlogp| %.2e, mean %.2e over %d tokens", result.max_abs,
                    result.mean_abs, result.tokens)
        return result

    def _deliver(self, stream: Iterable[Bucket]) -> dict[str, Any]:
        from actorcore.export.stream import iter_tensors

        if self.colocated:
            return vllm_worker.apply_update(self._worker, iter_tensors(stream))
        if self.transport == "ipc":
            return self._deliver_ipc(stream)
        if self._group is None:
            raise ValueError("transport='group' needs bridge.connect_group(...) first")
        return self._deliver_group(stream)

    def _deliver_ipc(self, stream: Iterable[Bucket]) -> dict[str, Any]:
        from multiprocessing.connection import Listener

        from actorcore.export.ipc import ipc_send

        authkey = secrets.token_bytes(32)
        with tempfile.TemporaryDirectory(prefix="actorcore-vllm-") as folder:
            address = os.path.join(folder, "stream.sock")
            with Listener(address, family="AF_UNIX", authkey=authkey) as listener:
                receiving = _InThread(lambda: self._rpc("actorcore_update_ipc", address=address,
                                                        authkey=authkey.hex(), timeout=self.timeout))
                connection = _accept(listener, receiving)
                with connection:
                    try:
                        ipc_send(stream, connection, timeout=self.timeout)
                    except BaseException:
                        receiving.result(swallow=True)  # the worker reports and blocks; ours is the error raised
                        raise
                return _one_report(receiving.result())

    def _deliver_group(self, stream: Iterable[Bucket]) -> dict[str, Any]:
        from actorcore.export.transport import broadcast_stream

        receiving = _InThread(lambda: self._rpc("actorcore_update_broadcast", src=0))
        try:
            for _ in broadcast_stream(stream, self._group, 0):
                pass
        except BaseException:
            receiving.result(swallow=True)
            raise
        return _one_report(receiving.result())

    def _abort_unfinished(self) -> None:
        engine = self.llm.llm_engine
        states = getattr(getattr(engine, "output_processor", None), "request_states", None)
        if states:
            logger.warning("aborting %d requests that ran into the blocked engine", len(states))
            engine.abort_request(list(states), internal=True)

    def _block(self, reason: str) -> None:
        if self.colocated:
            vllm_worker.block(vllm_worker.engine_model(self._worker), reason)
        else:
            self._rpc("actorcore_block", reason=reason)

    @property
    def blocked(self) -> str | None:
        """Why the engine refuses to generate (a failed update), or ``None``."""
        if self.colocated:
            return vllm_worker.blocked_reason(vllm_worker.engine_model(self._worker))
        return next((r for r in self._rpc("actorcore_blocked") if r), None)

    def _engine_probe(self, with_generation: bool) -> dict[str, Any]:
        """The engine's log-probs of the probe prompt (each token given the ones before it), and of tokens it
        generates after the probe (a request that reads the prefix cache; prompt log-probs never do)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=self.probe_batch.input_ids.tolist())
        scored = self.llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0,
                                                            detokenize=False), use_tqdm=False)[0]
        ids = prompt["prompt_token_ids"]
        prompt_lp = [0.0] + [entry[token].logprob for token, entry in zip(ids[1:], scored.prompt_logprobs[1:])]
        out: dict[str, Any] = {"prompt_ids": ids, "prompt": torch.tensor(prompt_lp, dtype=torch.float32),
                               "generated_ids": [],
                               "generated": torch.zeros(0)}
        if with_generation and self.generated:
            sampling = SamplingParams(max_tokens=self.generated, logprobs=0,
                                      temperature=1.0, seed=self.updates + 1, detokenize=False, ignore_eos=True)
            done = self.llm.generate([prompt], sampling, use_tqdm=False)[0].outputs[0]
            out["generated_ids"] = list(done.token_ids)
            out["generated"] = torch.tensor([lp[t].logprob for t, lp in zip(done.token_ids, done.logprobs)],
                                            dtype=torch.float32)
        return out


def _one_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' reports as one: every worker must have taken the same tensors (tensor parallel shards)."""
    counts = {r["tensors"] for r in reports}
    if len(counts) != 1:
        raise EngineUpdateError(f"the engine's workers took different numbers of tensors ({sorted(counts)})")
    return reports[0]


def _vocab_size(hf_config: Any) -> int:
    return int(getattr(_text_config(hf_config), "vocab_size"))


_SHAPING_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def _check_same_model(reference: Any, engine_config: Any) -> None:
    """A trainer's model whose config differs from the engine's in a field that shapes the weights is refused before
    anything reaches the engine (its stream could not update it exactly)."""
    trainer_config = getattr(reference, "config", None) if isinstance(reference, torch.nn.Module) else None
    if trainer_config is None:
        return
    trainer_text, engine_text = _text_config(trainer_config), _text_config(engine_config)
    differ = [f"{field}: trainer {getattr(trainer_text, field)!r}, engine {getattr(engine_text, field)!r}"
              for field in _SHAPING_FIELDS
              if hasattr(trainer_text, field) and hasattr(engine_text, field)
              and getattr(trainer_text, field) != getattr(engine_text, field)]
    if differ:
        raise ValueError(f"the trainer's model is not the engine's ({'; '.join(differ)}): start the engine from the "
                         "trainer's model (save_pretrained), or pass the model the engine runs. The engine was not "
                         "touched")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config


def _worker_in_process(llm: Any) -> Any:
    """The engine's one worker when it lives in this process (vLLM's in-process engine, one worker), else None."""
    executor = getattr(llm.llm_engine, "model_executor", None)
    driver = getattr(executor, "driver_worker", None)
    worker = getattr(driver, "worker", driver)
    return worker if worker is not None and getattr(worker, "model_runner", None) is not None else None


def _reference_function(reference: Any, probe_batch: PackedBatch) -> Callable[[PackedBatch], torch.Tensor]:
    """``PackedBatch -> float32 log-probs [T]`` of the trainer, from what the caller passed."""
    if isinstance(reference, torch.Tensor):
        expected = reference.detach().float().cpu().reshape(-1)
        if expected.numel() != probe_batch.input_ids.numel():
            raise ValueError(f"reference holds {expected.numel()} log-probs; bridge.probe_batch has "
                             f"{probe_batch.input_ids.numel()} tokens (compute it with "
                             "compute_logprobs(model, bridge.probe_batch).log_probs)")

        def precomputed(batch: PackedBatch) -> torch.Tensor:
            if batch.input_ids.numel() != expected.numel():
                raise ValueError("a precomputed reference covers bridge.probe_batch only")
            return expected
        return precomputed
    if isinstance(reference, torch.nn.Module):
        from actorcore.hf.logprobs import compute_logprobs

        def of_model(batch: PackedBatch) -> torch.Tensor:
            device = next(reference.parameters()).device
            with torch.no_grad(), _in_eval_mode(reference):
                return compute_logprobs(reference, batch.to(device), entropy=False).log_probs.float().cpu()
        return of_model
    if type(reference).__name__ == "McoreModel":
        from actorcore.mcore.run.forward import compute_logprobs as mcore_logprobs

        def of_mcore(batch: PackedBatch) -> torch.Tensor:
            with torch.no_grad():
                return mcore_logprobs(reference, batch).log_probs.float().cpu()
        return of_mcore
    if callable(reference):
        return lambda batch: torch.as_tensor(reference(batch)).detach().float().cpu().reshape(-1)
    raise ValueError(f"reference must be the trainer's model, an McoreModel, a function of a PackedBatch, or a "
                     f"tensor of log-probs of bridge.probe_batch; got {type(reference).__name__}")


@contextlib.contextmanager
def _in_eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode, each module's own mode back afterwards: a trainer's model is in train mode, and its
    dropout (which the engine does not run) would make the probe's reference random."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


class _InThread:
    """Run ``fn`` in a thread (an RPC that waits while this thread streams); ``result()`` joins and re-raises."""

    def __init__(self, fn: Callable[[], Any]):
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="actorcore-vllm-rpc")
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._error = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, swallow: bool = False) -> Any:
        self._thread.join()
        if self._error is not None and not swallow:
            raise self._error
        return self._result


def _accept(listener: Any, receiving: _InThread) -> Any:
    """The worker's connection, or the worker's error if it failed before connecting."""
    import select

    sock = getattr(getattr(listener, "_listener", None), "_socket", None)
    if sock is None:  # no socket to wait on: accept blocks until the worker connects
        return listener.accept()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.2)
        if ready:
            return listener.accept()
        if receiving.done:
            receiving.result()
            raise EngineUpdateError("the engine's worker ended its update without connecting to the stream")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
