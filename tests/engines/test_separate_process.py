"""The separate-process layout (vLLM's default): the engine in its own process with actorcore's worker extension,
driven by ``collective_rpc``; the stream over actorcore's IPC transport (shared memory), then over a process group
joining the trainer and the engine's worker (``broadcast_stream``). Three updates each, after optimizer steps, with
sampled-token agreement at temperature 1.0 and 0.7; for a tied dense model and a MoE model (the two post-processing
paths the worker reruns; the worker-side update is the same code the colocated tests run for every family)."""

from __future__ import annotations

import pytest

from actorcore.testing.engines import ENGINE_FAMILIES, engine_model, save_for_engine, start_engine, train_and_update
from actorcore.testing.tolerances import TOL


@pytest.fixture
def engine_processes(monkeypatch):
    """vLLM's engine core and workers in their own processes. vLLM caches its environment at the first in-process
    engine (the session's), so the variable alone would give an in-process engine core over worker processes, whose
    shutdown tears down this process's vLLM groups, which the session's engines share: the cache is lifted for the
    test. ``check(llm)`` asserts the engine core runs elsewhere."""
    import vllm.envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # never fork a process holding engines
    monkeypatch.setattr(vllm.envs, "__getattr__", getattr(vllm.envs.__getattr__, "__wrapped__",
                                                          vllm.envs.__getattr__))

    def check(llm):
        assert type(llm.llm_engine.engine_core).__name__ != "InprocClient", "the engine core runs in this process"
        return llm
    return check


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
def test_updates_over_ipc_and_a_process_group(model_type, tmp_path, engine_processes):
    from actorcore.engines import WORKER_EXTENSION, VllmBridge

    overrides, _ = ENGINE_FAMILIES[model_type]
    model = engine_model(model_type, overrides)
    llm = engine_processes(start_engine(save_for_engine(model, str(tmp_path / "model")),
                                        worker_extension_cls=WORKER_EXTENSION))
    try:
        bridge = VllmBridge(llm, transport="ipc")
        assert not bridge.colocated
        atol = TOL["engine_vs_actorcore_fp32"]
        reports = train_and_update(model, llm, bridge, 3, atol, dict(bucket_bytes=20_000))
        assert all(r.tensors > 0 for r in reports)
        assert bool(reports[-1].experts_repacked) == (model_type == "qwen3_moe")
        assert bool(reports[-1].reprocessed_shared) == (model_type == "qwen2")
        bridge.connect_group()  # gloo: the trainer is rank 0, the engine's one worker rank 1
        assert bridge.transport == "group"
        train_and_update(model, llm, bridge, 3, atol, dict(bucket_bytes=20_000))
        assert bridge.updates == 6 and bridge.blocked is None
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_an_engine_without_the_extension_is_refused(tmp_path, engine_processes):
    from actorcore.engines import VllmBridge

    overrides, _ = ENGINE_FAMILIES["qwen3"]
    llm = engine_processes(start_engine(save_for_engine(engine_model("qwen3", overrides), str(tmp_path / "model"))))
    try:
        with pytest.raises(ValueError, match="worker_extension_cls='actorcore.engines.vllm_worker"):
            VllmBridge(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
