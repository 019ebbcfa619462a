"""The library's writers and receivers against a hostile but fair caller: a tied model refuses an untied stream
(naming the tensors), ``save_sharded_safetensors`` makes its directory and files as the umask says, removes its
temporary directory on SIGTERM / SIGINT while handing the signal on to the caller's handler (or the default action),
and sweeps the temporaries of killed writers."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from actorcore.export import hf_weight_stream, load_into, save_sharded_safetensors
from actorcore.testing.tiny_configs import build_tiny_model


def test_a_tied_model_refuses_an_untied_stream_naming_both_tensors():
    tied = build_tiny_model("llama", seed=1, tie_word_embeddings=True)
    untied = build_tiny_model("llama", seed=2)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"both 'model.embed_tokens.weight' and 'lm_head.weight'.*one tied tensor"):
        load_into(tied, hf_weight_stream(untied, names="model"))
    with pytest.raises(ValueError, match=r"without 1 of the model's tensors: \['lm_head.weight'\].*tied"):
        load_into(untied, hf_weight_stream(tied, names="model"))
    other = build_tiny_model("llama", seed=3, tie_word_embeddings=True)  # same structure: loads, tie kept
    load_into(tied, hf_weight_stream(other, names="model"))
    assert torch.equal(tied.lm_head.weight, other.model.embed_tokens.weight)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def _stream(n=6, width=300):
    gen = torch.Generator().manual_seed(0)
    for k in range(n):
        yield [(f"w{k}", torch.randn(width, generator=gen))]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_written_directory_and_files_follow_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        out = tmp_path / "out"
        save_sharded_safetensors(_stream(), str(out), max_shard_bytes=2500)
    finally:
        os.umask(previous)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask
    names = sorted(os.listdir(out))
    assert len(names) == 4 and "model.safetensors.index.json" in names  # 3 shards + the index
    for name in names:
        assert os.stat(out / name).st_mode & 0o777 == 0o666 & ~umask, name


def _signalling(signum, at=3):
    for k, bucket in enumerate(_stream()):
        if k == at:
            os.kill(os.getpid(), signum)  # delivered at once: the writer is mid-shard
        yield bucket


def _leftovers(parent):
    return sorted(n for n in os.listdir(parent) if n.startswith(".out.tmp-") or n == "out")


def test_a_signal_removes_the_temporary_and_reaches_the_callers_handler(tmp_path):
    from actorcore.lifecycle import Interrupted

    calls = []

    def callers_handler(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:
        with pytest.raises(Interrupted):  # the caller's handler returned: the write still did not complete
            save_sharded_safetensors(_signalling(signal.SIGTERM), str(tmp_path / "out"), max_shard_bytes=2500)
        assert calls == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is callers_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert _leftovers(tmp_path) == []
    with pytest.raises(KeyboardInterrupt):  # SIGINT with Python's own handler: a KeyboardInterrupt, as always
        save_sharded_safetensors(_signalling(signal.SIGINT), str(tmp_path / "out"), max_shard_bytes=2500)
    assert _leftovers(tmp_path) == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


_TERMINATED_WRITER = textwrap.dedent("""
    import os, signal, sys
    import torch
    from actorcore.export import save_sharded_safetensors

    def stream():
        for k in range(6):
            if k == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            yield [(f"w{k}", torch.zeros(300))]

    save_sharded_safetensors(stream(), os.path.join(sys.argv[1], "out"), max_shard_bytes=2500)
    print("not reached")
""")


def test_sigterm_with_the_default_action_cleans_up_and_still_ends_the_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _TERMINATED_WRITER, str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == -signal.SIGTERM and "not reached" not in done.stdout, done.stderr
    assert _leftovers(tmp_path) == []


def test_temporaries_carry_the_pid_and_those_of_dead_writers_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.tmp-{int(dead.stdout)}-beef"
    stale.mkdir()
    (stale / "shard-00000.tmp").write_bytes(b"partial")
    alive = tmp_path / f".out.tmp-{os.getppid()}-cafe"  # a running process's: left alone
    alive.mkdir()
    seen = []

    def watching():
        for bucket in _stream(2):
            seen.append(sorted(n for n in os.listdir(tmp_path) if n.startswith(f".out.tmp-{os.getpid()}-")))
            yield bucket

    save_sharded_safetensors(watching(), str(tmp_path / "out"))
    assert not stale.exists() and alive.exists()
    assert seen and all(len(names) == 1 for names in seen)  # the writer's own temporary names its pid
