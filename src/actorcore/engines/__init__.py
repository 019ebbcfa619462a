"""Rollout engines fed from the trainer: a bridge per engine that makes a weight update exact or loud
(``VllmBridge``), and the trainer-engine agreement of a rollout's log-probs (``rollout_agreement``). vLLM itself is
imported only by what runs it (the bridge's calls, the worker extension inside vLLM's process)."""

from actorcore.engines.agreement import Agreement, rollout_agreement
from actorcore.engines.probe import ProbeResult
from actorcore.engines.vllm import EngineUpdate, VllmBridge
from actorcore.engines.vllm_worker import TESTED_VLLM, WORKER_EXTENSION
from actorcore.errors import EngineUpdateError

__all__ = ["Agreement", "EngineUpdate", "EngineUpdateError", "ProbeResult", "TESTED_VLLM", "VllmBridge",
           "WORKER_EXTENSION", "rollout_agreement"]
