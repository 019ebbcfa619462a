"""``actorcore convert`` stopped by SIGINT (Ctrl-C: the whole process group) or SIGTERM (a batch scheduler: the
main process) at named points of a real conversion exits within seconds, leaves no process it started, no
output and no temporary directory. The conversion runs as ``python -m actorcore convert`` and pauses at a
point through ``ACTORCORE_TEST_PAUSE_AT``, so that the signal arrives there deterministically."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("megatron.core")

EXIT_WITHIN_S = 15.0  # from the signal to the exit code, on a loaded 2-core machine
STARTUP_S = 180.0


def _src_root() -> str:
    import actorcore

    return os.path.dirname(os.path.dirname(os.path.abspath(actorcore.__file__)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from actorcore.cli.convert import main
    from actorcore.testing.tiny_configs import build_tiny_model

    root = tmp_path_factory.mktemp("signals")
    build_tiny_model("llama", seed=11).save_pretrained(str(root / "hf"))
    assert main(["hf-to-mcore", str(root / "hf"), str(root / "mcore")]) == 0
    return str(root / "hf"), str(root / "mcore")


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _stop_at(tmp_path, argv: list[str], point: str, signum: int, paused: int) -> None:
    dst = argv[2]
    marker = tmp_path / "paused"
    env = dict(os.environ, ACTORCORE_TEST_PAUSE_AT=point, ACTORCORE_TEST_PAUSED_FILE=str(marker),
               PYTHONPATH=os.pathsep.join([_src_root(), os.environ.get("PYTHONPATH", "")]))
    stderr = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "actorcore", "convert", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not (marker.exists() and len(marker.read_text().splitlines()) >= paused):
            assert proc.poll() is None, open(tmp_path / "stderr").read()
            assert time.monotonic() < deadline, f"never paused at {point}"
            time.sleep(0.2)
        started = _descendants(proc.pid)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # a terminal's Ctrl-C reaches the whole foreground process group
        else:
            os.kill(proc.pid, signum)  # a scheduler signals the job's main process
        sent = time.monotonic()
        code = proc.wait(timeout=EXIT_WITHIN_S)
        assert time.monotonic() - sent < EXIT_WITHIN_S
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 5.0
    while any(_running(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in started if _running(p)] == []
    err = open(tmp_path / "stderr").read()
    assert code == 128 + signum, err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        f"error: interrupted by {signal.Signals(signum).name}; nothing was written to {dst}"], err
    assert not os.path.exists(dst)
    assert [n for n in os.listdir(os.path.dirname(dst)) if ".tmp-" in n] == []


def _stop_in_process(tmp_path, monkeypatch, capsys, argv: list[str], point: str, signum: int) -> None:
    """The same in this process (cheap, so every point and signal): a thread signals it once it paused."""
    import threading

    from actorcore.cli.convert import main

    marker = tmp_path / "paused"
    monkeypatch.setenv("ACTORCORE_TEST_PAUSE_AT", point)
    monkeypatch.setenv("ACTORCORE_TEST_PAUSED_FILE", str(marker))

    def send() -> None:
        while not marker.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    threading.Thread(target=send, daemon=True).start()
    assert main(argv) == 128 + signum
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        f"error: interrupted by {signal.Signals(signum).name}; nothing was written to {argv[2]}"], err
    assert not os.path.exists(argv[2])
    assert [n for n in os.listdir(os.path.dirname(argv[2])) if ".tmp-" in n] == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("point", ["loading", "saving", "renaming"])
def test_signal_during_hf_to_mcore(tmp_path, monkeypatch, capsys, checkpoints, point, signum):
    _stop_in_process(tmp_path, monkeypatch, capsys, ["hf-to-mcore", checkpoints[0], str(tmp_path / "out")], point,
                     signum)


@pytest.mark.parametrize("point", ["loading", "exporting", "renaming"])
def test_signal_during_mcore_to_hf(tmp_path, monkeypatch, capsys, checkpoints, point):
    _stop_in_process(tmp_path, monkeypatch, capsys, ["mcore-to-hf", checkpoints[1], str(tmp_path / "back")], point,
                     signal.SIGTERM)


def test_sigterm_to_a_real_process(tmp_path, checkpoints):
    """Without the handler, SIGTERM would kill Python at once and leave the temporary directory."""
    _stop_at(tmp_path, ["hf-to-mcore", checkpoints[0], str(tmp_path / "out")], "saving", signal.SIGTERM, paused=1)


@pytest.mark.parametrize("point,signum", [("loading", signal.SIGTERM), ("saving", signal.SIGINT)])
def test_signal_with_rank_processes(tmp_path, checkpoints, point, signum):
    """--tp 2: both ranks paused in their own processes; the parent is signalled and must take them down."""
    _stop_at(tmp_path, ["hf-to-mcore", checkpoints[0], str(tmp_path / "out"), "--tp", "2"], point, signum, paused=2)
