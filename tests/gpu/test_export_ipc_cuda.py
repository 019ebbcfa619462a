"""The same-machine transport over CUDA IPC (one GPU, two processes): the receiving process rebuilds the sender's
flat buffers from plain-data handles and loads bitwise the sender's tensors; large buckets written by the sender
and read at once by the receiver (the inter-process event must order them) arrive whole; a receiver that dies
stops the sender with an error. The protocol itself is tested on the CPU in
tests/dist/test_export_ipc.py. Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from support.receiving import module_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TIMEOUT = 120.0


def _big_tensors(device):
    """Large random tensors (the sender's copies take a while): what the receiver must see whole."""
    gen = torch.Generator(device=device).manual_seed(11)
    return [(f"big.{k}", torch.randn(4096, 2048 + 64 * k, generator=gen, device=device).to(
        torch.bfloat16 if k % 2 else torch.float32)) for k in range(12)]


def _receiver(conn, scenario, spec, out_path):
    from actorcore.export import ipc_receive, load_into

    torch.cuda.set_device(0)
    result = {}
    try:
        if scenario == "ok":
            model = module_of(spec, "cuda")
            with ipc_receive(conn, timeout=TIMEOUT) as stream:
                devices = set()

                def watch(buckets):
                    for bucket in buckets:
                        devices.update(str(t.device) for _, t in bucket)
                        yield bucket

                load_into(model, watch(stream))
            result["state"] = {n: t.cpu() for n, t in model.state_dict().items()}
            result["devices"] = sorted(devices)
            want = dict(_big_tensors("cuda"))
            equal = {}
            for bucket in ipc_receive(conn, timeout=TIMEOUT):  # read as soon as it arrives
                for name, tensor in bucket:
                    equal[name] = bool(torch.equal(tensor, want[name]))
            result["big_equal"] = equal
        elif scenario == "dies":
            for k, _ in enumerate(ipc_receive(conn, timeout=TIMEOUT)):
                if k == 1:
                    os._exit(3)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
    torch.save(result, out_path)


def _start(tmp_path, scenario, spec=()):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # CUDA in a child needs spawn
    here, there = ctx.Pipe()
    out = str(tmp_path / f"{scenario}.pt")
    process = ctx.Process(target=_receiver, args=(there, scenario, list(spec), out))
    process.start()
    there.close()
    return here, process, out


def test_cuda_ipc_round_trip_is_bitwise_and_ordered(tmp_path):
    from actorcore.export import hf_weight_stream, ipc_send
    from actorcore.testing.tiny_configs import build_tiny_model

    torch.cuda.set_device(0)
    model = build_tiny_model("qwen3_moe").cuda()
    spec = [(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]
    conn, process, out = _start(tmp_path, "ok", spec)
    stats = ipc_send(hf_weight_stream(model, bucket_bytes=6_000, names="model"), conn, buffer_bytes=20_000,
                     timeout=TIMEOUT)
    big = _big_tensors("cuda")
    big_stats = ipc_send([[pair] for pair in big], conn, buffer_bytes=3 * 4096 * 2048 * 4, timeout=TIMEOUT)
    process.join(TIMEOUT)
    got = torch.load(out, weights_only=True)
    assert process.exitcode == 0 and "error" not in got, got.get("error")
    assert got["devices"] == ["cuda:0"]
    for name, tensor in model.state_dict().items():
        assert got["state"][name].dtype == tensor.dtype and torch.equal(got["state"][name], tensor.cpu()), name
    assert stats.buckets > 3 and stats.buffer_bytes > 20_000 and stats.tensors == len(spec)
    assert got["big_equal"] == {name: True for name, _ in big}
    assert big_stats.buckets >= 4 and big_stats.overlapped >= 1


def test_cuda_receiver_that_dies_stops_the_sender(tmp_path):
    from actorcore.export import TransportError, hf_weight_stream, ipc_send
    from actorcore.testing.tiny_configs import build_tiny_model

    torch.cuda.set_device(0)
    model = build_tiny_model("qwen3_moe").cuda()
    conn, process, out = _start(tmp_path, "dies")
    with pytest.raises(TransportError, match="closed the channel"):
        ipc_send(hf_weight_stream(model, bucket_bytes=4_000), conn, buffer_bytes=4_000, timeout=TIMEOUT)
    process.join(TIMEOUT)
    assert process.exitcode == 3
