"""ipc_send / ipc_receive over CPU shared memory: a received tensor stays valid for as long as the consumer holds it
(a disk writer holding a shard's tensors gets bitwise the sender's bytes, with nothing copied), a peer that dies is
noticed without a timeout even while this process still holds its end of the pipe, and SIGTERM in the sender leaves
no buffer in /dev/shm."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from actorcore.export import TransportError, hf_weight_stream, ipc_receive, ipc_send
from actorcore.export.ipc_buffers import shm_dir

BOUND_S = 30.0  # the longest any of these waits may take on a loaded machine; the peer check is every 0.5 s


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "actorcore.export"])
    return ctx


def _write_to_disk(conn, out_dir):
    """The issue's receiver: what ipc_receive yields goes straight into the sharded safetensors writer, whose
    shards hold the tensors of several buckets before writing them."""
    from actorcore.export import save_sharded_safetensors

    torch.set_num_threads(1)
    with ipc_receive(conn, timeout=BOUND_S) as stream:
        save_sharded_safetensors(stream, out_dir, max_shard_bytes=50_000)


def test_a_disk_writer_holding_received_tensors_gets_the_senders_bytes(tmp_path):
    from safetensors.torch import load_file

    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("qwen2", seed=5)
    ctx = _context()
    here, there = ctx.Pipe()
    out = str(tmp_path / "received")
    process = ctx.Process(target=_write_to_disk, args=(there, out))
    process.start()
    there.close()
    stats = ipc_send(hf_weight_stream(model, bucket_bytes=20_000), here, buffer_bytes=30_000, timeout=BOUND_S)
    process.join(BOUND_S)
    assert process.exitcode == 0
    got = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            got.update(load_file(os.path.join(out, name)))
    want = {n: t for b in hf_weight_stream(model, bucket_bytes=20_000) for n, t in b}
    assert sorted(got) == sorted(want) and len(want) == 27
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert stats.retired >= 1  # buffers whose tensors the writer still held were not rewritten


def test_every_yielded_tensor_held_to_the_end_keeps_its_bytes_and_released_buffers_are_reused():
    """One process, two threads. Holding: every tensor kept to the end is bitwise what was sent (before, the sender
    refilled the buffers under them). Releasing (a loader that copies): the two buffers are reused, none retired."""
    gen = torch.Generator().manual_seed(2)
    buckets = [[(f"w{k}.{i}", torch.randn(7 + k, 5, generator=gen)) for i in range(3)] for k in range(12)]
    for hold in (True, False):
        here, there = multiprocessing.Pipe()
        result = {}

        def send():
            result["stats"] = ipc_send(buckets, here, buffer_bytes=512, timeout=BOUND_S)

        thread = threading.Thread(target=send)
        thread.start()
        kept = []
        with ipc_receive(there, timeout=BOUND_S) as stream:
            for bucket in stream:
                if hold:
                    kept += bucket
                else:
                    kept += [(n, t.clone()) for n, t in bucket]
                    del bucket
        thread.join(BOUND_S)
        sent = [p for b in buckets for p in b]
        assert [n for n, _ in kept] == [n for n, _ in sent]
        for (name, tensor), (_, received) in zip(sent, kept):
            assert torch.equal(received, tensor), (hold, name)
        stats = result["stats"]
        assert stats.buckets == 12 and stats.retired == (12 if hold else 0), (hold, stats)


def _dies_after_one_bucket(conn):
    for k, _ in enumerate(ipc_receive(conn)):
        if k == 1:
            os._exit(3)


def _sends_one_bucket_and_dies(conn):
    def stream():
        yield [("a", torch.ones(8))]
        os._exit(4)
    ipc_send(stream(), conn, buffer_bytes=64, buffers=1)


def _run_bounded(fn):
    """``fn()`` in a daemon thread: its exception, or a failure if it is still waiting after BOUND_S."""
    outcome = {}

    def target():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"still waiting after {BOUND_S} s for a peer that died"
    return outcome.get("error"), time.monotonic() - start


def test_a_dead_receiver_is_noticed_while_this_process_still_holds_its_pipe_end():
    """The usual ``Process(target=engine, args=(child_conn,))`` without closing ``child_conn``: the pipe never
    closes, no timeout is set; the receiver's pid, from its ready message, tells that it died."""
    from actorcore.testing.tiny_configs import build_tiny_model

    ctx = _context()
    here, there = ctx.Pipe()
    process = ctx.Process(target=_dies_after_one_bucket, args=(there,))
    process.start()  # ``there`` stays open here, as in the issue
    error, _ = _run_bounded(lambda: ipc_send(hf_weight_stream(build_tiny_model("qwen3_moe"), bucket_bytes=4_000),
                                             here, buffer_bytes=4_000))
    process.join(BOUND_S)
    assert process.exitcode == 3
    assert isinstance(error, TransportError) and f"pid {process.pid}" in str(error) and "ended" in str(error)
    assert [f for f in os.listdir(shm_dir()) if f.startswith(f"actorcore-ipc-{os.getpid()}-")] == []


def test_a_dead_sender_is_noticed_while_this_process_still_holds_its_pipe_end():
    ctx = _context()
    here, there = ctx.Pipe()
    process = ctx.Process(target=_sends_one_bucket_and_dies, args=(there,))
    process.start()

    def receive():
        for _ in ipc_receive(here):
            pass

    error, _ = _run_bounded(receive)
    process.join(BOUND_S)
    assert process.exitcode == 4
    assert isinstance(error, TransportError) and f"pid {process.pid}" in str(error)


_STALLED_SENDER = textwrap.dedent("""
    import json, multiprocessing, sys, threading, time
    import torch
    from actorcore.export import ipc_send

    here, there = multiprocessing.Pipe()

    def stalled_receiver():  # says ready, takes the first bucket, never acknowledges it
        there.recv_bytes()
        there.send_bytes(json.dumps(dict(op="ready", version=json.loads(sys.argv[1]))).encode())
        there.recv_bytes()
        print("waiting", flush=True)
        time.sleep(600)

    threading.Thread(target=stalled_receiver, daemon=True).start()
    ipc_send([[("a", torch.ones(1000))], [("b", torch.ones(1000))], [("c", torch.ones(1000))]], here,
             buffer_bytes=4096)
""")


def test_sigterm_in_the_sender_frees_its_shared_memory_and_still_ends_the_process():
    from actorcore.export.ipc import PROTOCOL_VERSION

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", _STALLED_SENDER, str(PROTOCOL_VERSION)], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "waiting"
        prefix = f"actorcore-ipc-{child.pid}-"
        assert [f for f in os.listdir(shm_dir()) if f.startswith(prefix)]  # buffers exist, not yet acknowledged
        child.send_signal(signal.SIGTERM)
        assert child.wait(BOUND_S) == -signal.SIGTERM  # the default action still ends it, after the cleanup
        assert [f for f in os.listdir(shm_dir()) if f.startswith(prefix)] == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_an_interrupt_while_a_buffer_is_created_leaves_no_file(monkeypatch):
    """The window the SIGTERM test can hit by chance: the shared-memory file exists, the buffer is not yet held by the
    sender (here the interrupt lands in ``torch.from_file``, after the file was created and sized). Nothing stays."""
    from actorcore.export import ipc_buffers
    from actorcore.export.ipc_buffers import SendBuffer
    from actorcore.lifecycle import Interrupted

    def interrupted(*args, **kwargs):
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(ipc_buffers.torch, "from_file", interrupted)
    prefix = f"actorcore-ipc-{os.getpid()}-"
    before = {f for f in os.listdir(shm_dir()) if f.startswith(prefix)}
    named = []
    with pytest.raises(Interrupted):
        SendBuffer("shm", 4096, torch.device("cpu"), named=named.append)
    assert len(named) == 1 and not os.path.exists(named[0])
    assert {f for f in os.listdir(shm_dir()) if f.startswith(prefix)} == before


def _killed_with_buffers_in_shm(conn):
    """Ships two buckets (the second buffer is new, not yet acknowledged, so its file is still named), packs a
    third, then dies by SIGKILL: no cleanup of its own runs."""
    def stream():
        for name in ("a", "b", "c"):
            yield [(name, torch.ones(64))]
        os.kill(os.getpid(), signal.SIGKILL)
    ipc_send(stream(), conn, buffer_bytes=256)


@pytest.mark.parametrize("close_our_end", [True, False], ids=["channel-closes", "pid-ends"])
def test_the_receiver_removes_the_buffers_a_sigkilled_sender_left(close_our_end):
    """SIGKILL runs no cleanup in the sender; the receiver knows its pid (hello) and, once that process is gone,
    unlinks the files it left in /dev/shm. Noticed by the channel closing, or by the pid alone."""
    ctx = _context()
    here, there = ctx.Pipe()
    process = ctx.Process(target=_killed_with_buffers_in_shm, args=(there,))
    process.start()
    if close_our_end:
        there.close()
    received = []

    def receive():
        for bucket in ipc_receive(here):
            received.extend(name for name, _ in bucket)

    error, _ = _run_bounded(receive)
    process.join(BOUND_S)
    assert process.exitcode == -signal.SIGKILL
    assert isinstance(error, TransportError), error
    assert received[:1] == ["a"]
    left = [f for f in os.listdir(shm_dir()) if f.startswith(f"actorcore-ipc-{process.pid}-")]
    for name in left:  # a failing run leaves nothing behind either
        os.unlink(os.path.join(shm_dir(), name))
    assert left == []
