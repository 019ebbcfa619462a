"""How the verl tests find verl: skipped where it is absent, except under ``make test``, which installs verl 0.7.1
and 0.9.1 into their own folders and sets ``ACTORCORE_REQUIRE_VERL`` to the version a run puts on the path, so
that a missing or broken install there is an error, never a silent skip."""

from __future__ import annotations

import importlib
import os

import pytest


def import_verl_or_skip(module: str, version: str, reason: str):
    if os.environ.get("ACTORCORE_REQUIRE_VERL") == version:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)
