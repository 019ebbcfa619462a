"""The CLI: ``demo`` on a local model directory, and ``python -m actorcore``."""

import subprocess
import sys

from actorcore.cli import main
from actorcore.testing.tiny_configs import build_tiny_model


def test_demo_on_a_local_model_directory(tmp_path, capsys):
    build_tiny_model("llama", seed=3).save_pretrained(tmp_path)
    assert main(["demo", "--model", str(tmp_path), "--sp", "0", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "actorcore packed + fused head" in out and "OK: packed path agrees" in out


def test_module_entry_point_help():
    done = subprocess.run([sys.executable, "-m", "actorcore", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "demo" in done.stdout and "convert" in done.stdout


def test_every_sub_command_has_help_and_there_is_a_version():
    for args in (["--help"], ["demo", "--help"], ["verify", "--help"], ["convert", "--help"],
                 ["convert", "hf-to-mcore", "--help"], ["convert", "mcore-to-hf", "--help"]):
        done = subprocess.run([sys.executable, "-m", "actorcore", *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage: actorcore" in done.stdout, (args, done.stderr)
    done = subprocess.run([sys.executable, "-m", "actorcore", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("actorcore ")
