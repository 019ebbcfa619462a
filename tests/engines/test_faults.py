"""Faults of an update, against the real engine: a stream that ends early, a tensor of the wrong shape, a model of
another architecture, a sender that dies mid-stream (the worker extension's IPC receiver, as in the separate-process
layout), a stream that raises. Each is a clear error; the engine is never reported updated: it refuses to generate
until an update succeeds, and the next good update makes it exact again."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal

import pytest
import torch

from actorcore.export import hf_weight_stream
from actorcore.testing.engines import ENGINE_FAMILIES, PROMPTS, engine_model, sample, save_for_engine, start_engine
from actorcore.testing.engines import training_step


def _setup(tmp_path, keep_engine, model_type="qwen3_moe"):
    from actorcore.engines import VllmBridge

    overrides, _ = ENGINE_FAMILIES[model_type]
    model = engine_model(model_type, overrides)
    llm = keep_engine(start_engine(save_for_engine(model, str(tmp_path / model_type))))
    bridge = VllmBridge(llm)
    training_step(model, torch.optim.Adam(model.parameters(), lr=2e-2), seed=1)
    return model, llm, bridge


def _assert_refuses_then_recovers(model, llm, bridge, match: str) -> None:
    assert match in bridge.blocked, bridge.blocked
    assert bridge.updates == 0
    with pytest.raises(RuntimeError, match="refuses to generate"):
        sample(llm, PROMPTS, 1.0, seed=0)
    report = bridge.update(hf_weight_stream(model), reference=model)
    assert report.probe.ok and bridge.blocked is None and bridge.updates == 1
    assert sample(llm, PROMPTS, 1.0, seed=0)[0]


def test_a_stream_that_ends_early(tmp_path, keep_engine):
    from actorcore.engines import EngineUpdateError

    model, llm, bridge = _setup(tmp_path, keep_engine)
    early = itertools.islice(hf_weight_stream(model, bucket_bytes=20_000), 4)
    with pytest.raises(EngineUpdateError, match="partial.*did not receive all their weights|received none"):
        bridge.update(early, reference=model)
    _assert_refuses_then_recovers(model, llm, bridge, "partial update")


def test_a_tensor_of_the_wrong_shape(tmp_path, keep_engine):
    from actorcore.engines import EngineUpdateError

    model, llm, bridge = _setup(tmp_path, keep_engine)

    def cut(stream):
        for bucket in stream:
            yield [(n, t[:-1] if n.endswith("layers.1.self_attn.o_proj.weight") else t) for n, t in bucket]

    with pytest.raises(EngineUpdateError, match=r"o_proj.weight' has shape \(63, 128\) in the weight stream but "
                                                r"\(64, 128\) in the engine's checkpoint"):
        bridge.update(cut(hf_weight_stream(model)), reference=model)
    _assert_refuses_then_recovers(model, llm, bridge, "o_proj.weight' has shape")


def test_a_model_of_another_architecture_is_refused_before_the_engine_is_touched(tmp_path, keep_engine):
    model, llm, bridge = _setup(tmp_path, keep_engine)
    other = engine_model("llama", ENGINE_FAMILIES["llama"][0])
    with pytest.raises(ValueError, match="is not the engine's.*model_type: trainer 'llama', engine 'qwen3_moe'"):
        bridge.update(hf_weight_stream(other), reference=other)
    assert bridge.blocked is None  # nothing reached the engine
    # the same stream with a reference that cannot tell: the engine's own account catches it
    from actorcore.engines import EngineUpdateError

    with pytest.raises(EngineUpdateError):
        bridge.update(hf_weight_stream(other), reference=lambda batch: torch.zeros(batch.num_tokens))
    _assert_refuses_then_recovers(model, llm, bridge, "")


def test_a_stream_that_raises(tmp_path, keep_engine):
    model, llm, bridge = _setup(tmp_path, keep_engine)

    def failing(stream):
        for k, bucket in enumerate(stream):
            if k == 2:
                raise KeyboardInterrupt  # the user pressed Ctrl-C while the trainer gathered a bucket
            yield bucket

    with pytest.raises(KeyboardInterrupt):
        bridge.update(failing(hf_weight_stream(model, bucket_bytes=20_000)), reference=model)
    _assert_refuses_then_recovers(model, llm, bridge, "KeyboardInterrupt")


def _dying_sender(address: str, authkey: bytes, model_type: str) -> None:
    """Serve the stream over IPC and die (SIGKILL) after two buckets, as a trainer killed mid-sync."""
    from multiprocessing.connection import Listener

    from actorcore.export import ipc_send

    overrides, _ = ENGINE_FAMILIES[model_type]
    model = engine_model(model_type, overrides, seed=3)

    def then_die(stream):
        for k, bucket in enumerate(stream):
            if k == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield bucket

    with Listener(address, family="AF_UNIX", authkey=authkey) as listener, listener.accept() as connection:
        ipc_send(then_die(hf_weight_stream(model, bucket_bytes=20_000)), connection)


def test_a_sender_that_dies_mid_stream(tmp_path, keep_engine):
    from actorcore.engines.vllm_worker import WeightSyncExtension
    from actorcore.errors import TransportError

    model, llm, bridge = _setup(tmp_path, keep_engine)
    worker = llm.llm_engine.model_executor.driver_worker.worker
    address, authkey = str(tmp_path / "stream.sock"), os.urandom(16)
    sender = multiprocessing.get_context("spawn").Process(target=_dying_sender,
                                                          args=(address, authkey, "qwen3_moe"))
    sender.start()
    try:
        for _ in range(200):
            if os.path.exists(address):
                break
            sender.join(0.05)
        with pytest.raises(TransportError, match="process .* ended|closed the channel"):
            WeightSyncExtension.actorcore_update_ipc(worker, address, authkey.hex())  # what collective_rpc runs
    finally:
        sender.join(30)
    assert sender.exitcode == -signal.SIGKILL
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"actorcore-ipc-{sender.pid}-")]
    _assert_refuses_then_recovers(model, llm, bridge, "TransportError")
