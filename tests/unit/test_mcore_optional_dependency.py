"""megatron-core is optional: the arch registry and actorcore.mcore import without it, and the entry points
say how to install it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_specs_and_mcore_package_do_not_import_megatron():
    code = ("import sys; import actorcore.archs as a; [a.get_spec(m) for m in a.registered_model_types()]; "
            "import actorcore.mcore, actorcore.archs.megatron_rules, actorcore.mcore.build.config, actorcore.mcore.convert.transforms; "
            "assert not [m for m in sys.modules if m.startswith('megatron')], 'megatron imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_megatron_is_a_clear_error(monkeypatch):
    from actorcore.mcore import _megatron

    monkeypatch.setitem(sys.modules, "megatron.core", None)
    _megatron.require_megatron.cache_clear()
    try:
        with pytest.raises(_megatron.MegatronNotInstalledError, match=r"pip install 'megatron-core>=0.16,<0.17' psutil"):
            _megatron.require_megatron()
    finally:
        _megatron.require_megatron.cache_clear()


def test_convert_cli_reports_missing_megatron(monkeypatch, tmp_path, capsys):
    from actorcore.mcore import _megatron
    from actorcore.cli.convert import main

    monkeypatch.setitem(sys.modules, "megatron.core", None)
    _megatron.require_megatron.cache_clear()
    try:
        assert main(["hf-to-mcore", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    finally:
        _megatron.require_megatron.cache_clear()
    assert "megatron-core" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()
