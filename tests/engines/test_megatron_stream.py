"""The Megatron route's weights into the engine: a model sharded at TP=2 (dense) and EP=2 (MoE) on two gloo
ranks, every rank iterating ``mcore_weight_stream``, rank 0 holding the engine (a separate engine process with
actorcore's worker extension: an engine inside a rank would join that rank's process group). Three optimizer steps
on the Megatron model, each followed by ``bridge.update`` verified against the Megatron route's own log-probs of the
probe (computed by every rank). After each update the engine's sampled-token log-probs (temperature 1.0 and 0.7)
equal, per token, actorcore's HF route on the streamed weights (the update is exact: 1e-5) and the Megatron route's
own (within that route's float32 numerics at TP=2, ``TOL["engine_vs_mcore_fp32"]``)."""

from __future__ import annotations

import os

import pytest
import torch

from actorcore.testing.distributed import run_distributed
from actorcore.testing.engines import ENGINE_FAMILIES, PROMPTS, engine_model, save_for_engine
from actorcore.testing.tolerances import TOL

pytest.importorskip("megatron.core")

CASES = [("qwen3", dict(tp=2)), ("qwen3_moe", dict(ep=2))]
LR = 0.05


def _broadcast(obj, src: int = 0):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _sgd_step(model, seed: int) -> None:
    """One SGD step on a policy-gradient-shaped loss (the same data on every rank: replicated weights stay equal)."""
    import actorcore as ac
    from actorcore.mcore.run.forward import compute_logprobs

    generator = torch.Generator().manual_seed(seed)
    batch = ac.pack([torch.randint(0, 131, (n,), generator=generator) for n in (9, 14, 6)])
    advantages = torch.randn(batch.num_tokens, generator=generator)
    params = [p for chunk in model.chunks for p in chunk.parameters()]
    for p in params:
        p.grad = None
    compute_logprobs(model, batch, entropy=False, loss_fn=lambda out, b: -(out.log_probs * advantages).mean())
    with torch.no_grad():
        for p in params:
            grad = getattr(p, "main_grad", None) if p.grad is None else p.grad
            if grad is not None:
                p.add_(grad, alpha=-LR)


def _worker(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    import actorcore as ac
    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import mcore_weight_stream

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # the group is up; the engine process must not read this launch's layout
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_WORKER_MULTIPROC_METHOD="spawn")
    results = {}
    with CpuRuntime():
        for model_type, sizes in CASES:
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            parallel = McoreParallel(**sizes)
            initialize_megatron(parallel)
            directory = os.path.join(root, model_type)
            model = build_gpt_model(AutoConfig.from_pretrained(directory), parallel)
            load_hf_into_mcore(model, directory)
            llm = bridge = None
            if rank == 0:
                from actorcore.engines import WORKER_EXTENSION, VllmBridge
                from actorcore.testing.engines import start_engine

                llm = start_engine(directory, worker_extension_cls=WORKER_EXTENSION)
                route = TOL["engine_vs_mcore_fp32"]
                bridge = VllmBridge(llm, tolerance=(route, route))
            probe = ac.pack([torch.tensor(_broadcast(bridge.probe_batch.input_ids.tolist() if rank == 0 else None))])
            diffs, exact = [], []
            try:
                for step in (1, 2, 3):
                    _sgd_step(model, seed=step)
                    with torch.no_grad():
                        reference = compute_logprobs(model, probe, entropy=False).log_probs
                    stream = mcore_weight_stream(model, bucket_bytes=20_000)
                    if rank == 0:
                        report = bridge.update(stream, reference=reference)
                        assert report.probe.ok
                    else:
                        for _ in stream:  # this rank takes part in the gathers
                            pass
                    streamed = _streamed_hf_model(model, os.path.join(root, f"{model_type}-{step}"), rank)
                    for temperature in (1.0, 0.7):
                        sampled = None
                        if rank == 0:
                            from actorcore.testing.engines import sample

                            sampled = sample(llm, PROMPTS, temperature, seed=10 * step)
                        completions, engine_lp = _broadcast(sampled)
                        batch = ac.pack([torch.tensor(p + c) for p, c in zip(PROMPTS, completions)])
                        with torch.no_grad():
                            ours = compute_logprobs(model, batch, temperature=temperature, entropy=False).log_probs
                        for i, (prompt, completion) in enumerate(zip(PROMPTS, completions)):
                            start = int(batch.cu_seqlens[i]) + len(prompt)
                            got = ours[start:start + len(completion)]
                            diffs.append(float((got - torch.tensor(engine_lp[i])).abs().max()))
                        if streamed is not None:
                            hf = ac.compute_logprobs(streamed, batch, temperature=temperature, entropy=False)
                            for i, (prompt, completion) in enumerate(zip(PROMPTS, completions)):
                                start = int(batch.cu_seqlens[i]) + len(prompt)
                                got = hf.log_probs[start:start + len(completion)].detach()
                                exact.append(float((got - torch.tensor(engine_lp[i])).abs().max()))
            finally:
                if llm is not None:
                    llm.llm_engine.engine_core.shutdown()
            results[model_type] = {"max_diff": max(diffs), "exact": max(exact) if exact else None,
                                   "updates": bridge.updates if bridge else None}
    return results


def _streamed_hf_model(model, directory: str, rank: int):
    """On rank 0, a transformers model holding exactly what ``mcore_weight_stream`` sends (written, then loaded);
    every rank takes part in the stream's gathers."""
    from transformers import AutoModelForCausalLM

    from actorcore.export import save_sharded_safetensors
    from actorcore.mcore.convert.weight_stream import mcore_weight_stream

    save_sharded_safetensors(mcore_weight_stream(model), directory, config=model.hf_config, write=rank == 0)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32) if rank == 0 else None


def test_megatron_route_streams_into_the_engine_exactly(tmp_path):
    for model_type, _ in CASES:
        overrides, _ = ENGINE_FAMILIES[model_type]
        save_for_engine(engine_model(model_type, overrides, seed=5), str(tmp_path / model_type))
    results = run_distributed(_worker, 2, args=(str(tmp_path),))
    for model_type, _ in CASES:
        assert results[0][model_type]["updates"] == 3
        assert results[0][model_type]["exact"] <= TOL["engine_vs_actorcore_fp32"], results
        for rank in (0, 1):
            assert results[rank][model_type]["max_diff"] <= TOL["engine_vs_mcore_fp32"], (rank, results)
