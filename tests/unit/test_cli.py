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
