"""The same-machine transport (ipc_send / ipc_receive) over CPU shared memory, between two processes: what the
receiver loads is bitwise the sender's, the double buffering overlaps packing with a slow receiver, buffers grow for
a large bucket, and every way to fail (a receiver that refuses a name, a receiver that dies, a sender interrupted,
malformed messages) ends both sides with a clear error and leaves no shared-memory file behind. The CUDA IPC flavour
of the same protocol is tests/gpu/test_export_ipc_cuda.py."""

import json
import multiprocessing
import os
import threading
import time

import pytest
import torch

from actorcore.export import TransportError, hf_weight_stream, ipc_receive, ipc_send
from actorcore.export.ipc import PROTOCOL_VERSION
from actorcore.export.ipc_buffers import shm_dir
from support.receiving import module_of

TIMEOUT = 60.0


def _context():
    # forkserver: children start in milliseconds from a server that imported torch but never ran a parallel op
    # (a plain fork of this process would hang in OpenMP); spawn would import torch again in every child.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "actorcore.export"])
    return ctx


def _odd_buckets():
    gen = torch.Generator().manual_seed(1)
    return [[("scalar", torch.tensor(2.5, dtype=torch.float64)), ("ids", torch.arange(5, dtype=torch.int64)),
             ("flags", torch.tensor([True, False, True])), ("half", torch.randn(3, 2, generator=gen).bfloat16()),
             ("empty", torch.zeros(0, 4)), ("strided", torch.arange(12.0).reshape(3, 4).t())],
            [], [("last", torch.ones(1, 7, dtype=torch.float16))]]


class _VllmStandIn:
    def __init__(self):
        self.seen = []

    def load_weights(self, weights):
        self.seen += [(n, t.clone()) for n, t in weights]
        return {n for n, _ in self.seen}


class _SglangStandIn:
    def __init__(self):
        self.seen, self.flushes = [], 0

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.seen += [(n, t.clone()) for n, t in named_tensors]

    def flush_cache(self):
        self.flushes += 1


def _spec(model):
    return [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]


def _receiver(conn, scenario, spec, out_path):
    """The receiving process: one scenario, its result saved with torch.save for the test to read."""
    from actorcore.export import load_into, load_into_sglang, load_into_vllm

    torch.set_num_threads(1)
    result = {}
    try:
        if scenario == "ok":
            model = module_of(spec)

            def slow(stream):  # a slow loader: the sender should be packing the next buffer meanwhile
                for bucket in stream:
                    time.sleep(0.02)
                    yield bucket

            with ipc_receive(conn, timeout=TIMEOUT) as stream:
                load_into(model, slow(stream))
            result["state"] = model.state_dict()
            result["odd"] = [[(n, t.clone()) for n, t in b] for b in ipc_receive(conn, timeout=TIMEOUT)]
            vllm, sglang = _VllmStandIn(), _SglangStandIn()
            result["vllm_loaded"] = sorted(load_into_vllm(vllm, ipc_receive(conn, timeout=TIMEOUT)))
            result["vllm"] = vllm.seen
            result["sglang_buckets"] = load_into_sglang(sglang, ipc_receive(conn, timeout=TIMEOUT))
            result["sglang"], result["flushes"] = sglang.seen, sglang.flushes
        elif scenario == "wrong_model":
            with ipc_receive(conn, timeout=TIMEOUT) as stream:
                load_into(module_of(spec), stream)
        elif scenario == "dies":
            for k, _ in enumerate(ipc_receive(conn, timeout=TIMEOUT)):
                if k == 1:
                    os._exit(3)
        elif scenario == "sender_interrupted":
            with ipc_receive(conn, timeout=TIMEOUT) as stream:
                for _ in stream:
                    pass
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
    torch.save(result, out_path)


def _start(tmp_path, scenario, spec=()):
    ctx = _context()
    here, there = ctx.Pipe()
    out = str(tmp_path / f"{scenario}.pt")
    process = ctx.Process(target=_receiver, args=(there, scenario, list(spec), out))
    process.start()
    there.close()  # only the child holds its end: its death closes the channel
    return here, process, out


def _finish(process, out):
    process.join(TIMEOUT)
    assert process.exitcode is not None, "the receiving process did not end"
    return torch.load(out, weights_only=True) if os.path.exists(out) else None


def _own_shm_files():
    return [f for f in os.listdir(shm_dir()) if f.startswith(f"actorcore-ipc-{os.getpid()}-")]


def test_two_processes_bitwise_double_buffered_and_the_receivers_accept_it(tmp_path):
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("qwen3_moe")
    conn, process, out = _start(tmp_path, "ok", _spec(model))
    stats = ipc_send(hf_weight_stream(model, bucket_bytes=6_000, names="model"), conn, buffer_bytes=20_000,
                     timeout=TIMEOUT)
    odd = ipc_send(_odd_buckets(), conn, buffer_bytes=256, timeout=TIMEOUT)
    checkpoint = list(hf_weight_stream(model, bucket_bytes=30_000, dtype=torch.bfloat16))
    ipc_send(checkpoint, conn, buffer_bytes=30_000, timeout=TIMEOUT)
    ipc_send(checkpoint, conn, buffer_bytes=30_000, timeout=TIMEOUT)
    got = _finish(process, out)
    assert process.exitcode == 0 and "error" not in got, got.get("error")
    want = model.state_dict()
    assert sorted(got["state"]) == sorted(want)
    for name, tensor in want.items():
        assert got["state"][name].dtype == tensor.dtype and torch.equal(got["state"][name], tensor), name
    # several stream buckets share one buffer; the embedding (131*64*4 bytes) grew a buffer past 20_000 bytes
    assert stats.buckets > 3 and stats.buffer_bytes > 20_000 and stats.tensors == len(want)
    assert stats.overlapped >= 1  # a buffer was packed while the receiver (sleeping) still held the other one
    assert odd.buckets == 2 and odd.buffer_bytes >= 256  # the one-float16 bucket could not join the first
    sent = [p for b in _odd_buckets() for p in b]
    assert [n for b in got["odd"] for n, _ in b] == [n for n, _ in sent]
    for (name, tensor), (_, received) in zip(sent, (p for b in got["odd"] for p in b)):
        assert received.dtype == tensor.dtype and received.shape == tensor.shape, name
        assert torch.equal(received, tensor), name
    pairs = [p for b in checkpoint for p in b]
    for key in ("vllm", "sglang"):
        assert [n for n, _ in got[key]] == [n for n, _ in pairs]
        for (name, tensor), (_, received) in zip(pairs, got[key]):
            assert received.dtype == torch.bfloat16 and torch.equal(received, tensor), (key, name)
    assert got["vllm_loaded"] == sorted(n for n, _ in pairs)
    assert got["sglang_buckets"] >= 1 and got["flushes"] == 1
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in dict(pairs)
    assert _own_shm_files() == []


def test_a_receiver_that_refuses_a_name_stops_the_sender_with_its_reason(tmp_path):
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("qwen3_moe")
    renamed = [(n + "_renamed" if n == "model.layers.0.mlp.experts.down_proj" else n, s, d) for n, s, d in _spec(model)]
    assert [n for n, _, _ in renamed if n.endswith("_renamed")]
    conn, process, out = _start(tmp_path, "wrong_model", renamed)
    with pytest.raises(TransportError, match=r"model.layers.0.mlp.experts.down_proj'.*does not have"):
        ipc_send(hf_weight_stream(model, bucket_bytes=6_000, names="model"), conn, buffer_bytes=6_000,
                 timeout=TIMEOUT)
    got = _finish(process, out)
    assert got["error"].startswith("ValueError: load_into") and "experts.down_proj" in got["error"]
    assert _own_shm_files() == []


def test_a_receiver_that_dies_is_reported_not_waited_for(tmp_path):
    from actorcore.testing.tiny_configs import build_tiny_model

    conn, process, out = _start(tmp_path, "dies")
    start = time.perf_counter()
    with pytest.raises(TransportError, match="closed the channel"):
        ipc_send(hf_weight_stream(build_tiny_model("qwen3_moe"), bucket_bytes=4_000), conn, buffer_bytes=4_000)
    assert time.perf_counter() - start < TIMEOUT  # no timeout given: the closed pipe, not a clock, ended it
    _finish(process, out)
    assert process.exitcode == 3 and _own_shm_files() == []


def test_an_interrupted_sender_tells_the_receiver_and_cleans_up(tmp_path):
    from actorcore.testing.tiny_configs import build_tiny_model

    def interrupted():
        for k, bucket in enumerate(hf_weight_stream(build_tiny_model("qwen3_moe"), bucket_bytes=4_000)):
            if k == 3:
                raise KeyboardInterrupt
            yield bucket

    conn, process, out = _start(tmp_path, "sender_interrupted")
    with pytest.raises(KeyboardInterrupt):
        ipc_send(interrupted(), conn, buffer_bytes=4_000, timeout=TIMEOUT)
    got = _finish(process, out)
    assert "TransportError" in got["error"] and "KeyboardInterrupt" in got["error"], got
    assert _own_shm_files() == []


class _Scripted:
    """A channel of send/recv strings that replays ``incoming`` and records what is sent."""

    def __init__(self, incoming):
        self.incoming, self.sent = list(incoming), []

    def send(self, data):
        self.sent.append(json.loads(data))

    def recv(self):
        if not self.incoming:
            raise EOFError
        return self.incoming.pop(0)


def _bucket_message(buffer, tensors, seq=0, slot=0):
    return json.dumps(dict(op="bucket", seq=seq, slot=slot, buffer=buffer, tensors=tensors))


_CUDA = dict(kind="cuda", nbytes=64, device=0, handle="00" * 64, size=64, offset=0,
             ref_handle=b"/torch_1_2_3".hex(), ref_offset=0, event_handle="00" * 64, event_sync=True,
             ready_event="00" * 64)


@pytest.mark.parametrize("bad, match", [
    (dict(buffer=dict(kind="shm", nbytes=64, name="../../etc/passwd")), "must look like"),
    (dict(buffer=dict(kind="shm", nbytes=64, name="actorcore-ipc-1-" + "0" * 32)), "does not exist"),
    (dict(buffer=dict(kind="pickle", nbytes=64)), "kind 'cuda' or 'shm'"),
    (dict(buffer=dict(_CUDA, device="0")), "needs 'device' as int"),
    (dict(buffer=dict(_CUDA, ref_handle=b"/../../etc/passwd".hex())), "ref_handle must name"),
    (dict(buffer=dict(_CUDA, device=99)), "does not see"),
    (dict(tensors=[["w", "torch.float32", [2], 0]]), "dtype 'torch.float32'"),
    (dict(tensors=[["w", "float32", [100], 0]]), "does not fit"),
    (dict(tensors=[["w", "float32", [2], 4]]), "does not fit an aligned"),
    (dict(tensors=[["w", "float32", [-1], 0]]), r"\[name, dtype, shape, offset\]"),
    (dict(slot=2), "slot 0 or 1"),
])
def test_malformed_messages_are_refused_and_the_sender_told(bad, match):
    from actorcore.export.ipc_buffers import SendBuffer

    real = SendBuffer("shm", 64, torch.device("cpu"))
    try:
        fields = dict(buffer=real.description, tensors=[["w", "float32", [2], 0]], slot=0)
        fields.update(bad)
        channel = _Scripted([json.dumps(dict(op="hello", version=PROTOCOL_VERSION)),
                             _bucket_message(fields["buffer"], fields["tensors"], slot=fields["slot"])])
        with pytest.raises(ValueError, match=match):
            next(iter(ipc_receive(channel)))
        assert channel.sent[-1]["op"] == "abort" and "ValueError" in channel.sent[-1]["reason"]
    finally:
        real.release()


def test_protocol_mismatches_and_pickles_are_refused():
    with pytest.raises(ValueError, match=f"protocol version {PROTOCOL_VERSION}"):
        next(iter(ipc_receive(_Scripted([json.dumps(dict(op="hello", version=PROTOCOL_VERSION + 1))]))))
    with pytest.raises(ValueError, match="not JSON"):
        next(iter(ipc_receive(_Scripted([b"\x80\x04\x95pickled"]))))
    with pytest.raises(ValueError, match=f"protocol version {PROTOCOL_VERSION}"):
        ipc_send([[("w", torch.zeros(2))]], _Scripted([json.dumps(dict(op="ready", version=0))]))
    with pytest.raises(ValueError, match="send_bytes/recv_bytes"):
        ipc_send([], object())
    with pytest.raises(TransportError, match="no the receiver's ready from the other side within"):
        here, _there = multiprocessing.Pipe()
        ipc_send([], here, timeout=0.05)
    receiver = ipc_receive(_Scripted([json.dumps(dict(op="hello", version=PROTOCOL_VERSION)), json.dumps(dict(op="end",
                                                                                              buckets=0))]))
    assert list(receiver) == []
    with pytest.raises(ValueError, match="iterated once"):
        iter(receiver)


def test_threads_share_the_protocol_and_the_consumer_stopping_early_is_told():
    """One process, two threads: a receiver that stops after one bucket (no context manager) aborts the sender."""
    here, there = multiprocessing.Pipe()
    errors = []

    def send():
        try:
            ipc_send([[("a", torch.ones(4))], [("b", torch.ones(40))], [("c", torch.ones(4))]], here,
                     buffer_bytes=64, timeout=TIMEOUT)
        except TransportError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=send)
    thread.start()
    stream = iter(ipc_receive(there, timeout=TIMEOUT))
    assert [n for n, _ in next(stream)] == ["a"]
    stream.close()
    thread.join(TIMEOUT)
    assert errors and "stopped reading before the end" in errors[0]
    assert _own_shm_files() == []


def test_an_interrupted_receiver_tells_the_sender():
    """Ctrl-C in the receiving process while it loads a bucket: the sender is told, with the reason."""
    from actorcore.export.ipc_buffers import SendBuffer

    real = SendBuffer("shm", 64, torch.device("cpu"))
    try:
        real.tensor[:8].view(torch.float32).copy_(torch.tensor([1.5, -2.0]))
        channel = _Scripted([json.dumps(dict(op="hello", version=PROTOCOL_VERSION)),
                             _bucket_message(real.description, [["w", "float32", [2], 0]])])
        with pytest.raises(KeyboardInterrupt):
            with ipc_receive(channel) as stream:
                for bucket in stream:
                    assert torch.equal(bucket[0][1], torch.tensor([1.5, -2.0]))
                    raise KeyboardInterrupt
        assert [m["op"] for m in channel.sent] == ["ready", "abort"]
        assert "KeyboardInterrupt" in channel.sent[-1]["reason"]
    finally:
        real.release()


def test_one_buffer_mode_is_bitwise_and_never_overlaps_packing():
    """buffers=1 (the memory bound of a sharded model): one buffer, rewritten only after each acknowledgement."""
    here, there = multiprocessing.Pipe()
    gen = torch.Generator().manual_seed(3)
    buckets = [[(f"w{k}.{j}", torch.randn(5 + k, 3, generator=gen)) for j in range(2)] for k in range(6)]
    stats = []
    thread = threading.Thread(target=lambda: stats.append(ipc_send(buckets, here, buffer_bytes=200, buffers=1,
                                                                   timeout=TIMEOUT)))
    thread.start()
    got = [(n, t.clone()) for b in ipc_receive(there, timeout=TIMEOUT) for n, t in b]
    thread.join(TIMEOUT)
    assert [n for n, _ in got] == [n for b in buckets for n, _ in b]
    for (_, want), (_, tensor) in zip((p for b in buckets for p in b), got):
        assert torch.equal(tensor, want)
    assert stats[0].buckets > 2 and stats[0].overlapped == 0
    with pytest.raises(ValueError, match="buffers must be 1 or 2"):
        ipc_send(buckets, here, buffers=3)
