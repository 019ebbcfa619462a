"""HF -> Megatron (sharded over TP / PP / EP) -> HF is bit-exact for every Megatron architecture (gloo, CPU)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from actorcore.testing.distributed import run_distributed

pytest.importorskip("megatron.core")


def _archs() -> tuple[list[str], list[str]]:
    """(dense, MoE) Megatron architectures, from the registry (MoE: a spec with per-expert rules)."""
    from actorcore.archs import get_spec
    from actorcore.mcore.model import megatron_model_types

    moe = [m for m in megatron_model_types() if any(r.parallel == "expert" for r in get_spec(m).mcore.rules)]
    return [m for m in megatron_model_types() if m not in moe], moe


DENSE, MOE = _archs()


def randomize_constant_tensors(model, seed: int = 0) -> None:
    """Norm weights (ones), biases and DeepSeek's expert bias (zeros) get distinct random values, so a
    mapping that swapped two of them could not pass."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point() and tensor.numel() > 1 and bool((tensor == tensor.flatten()[0]).all()):
                noise = torch.randn(tensor.shape, generator=gen) * 0.1
                tensor.copy_((tensor.float() + noise).to(tensor.dtype))


def _save_tiny(model_type: str, directory: str, **overrides) -> None:
    from actorcore.archs import get_spec
    from actorcore.testing.tiny_configs import build_tiny_model
    from actorcore.testing.tiny_vlm import build_tiny_vlm

    build = build_tiny_vlm if get_spec(model_type).vision is not None else build_tiny_model  # VLM: tower too
    model = build(model_type, seed=3, **overrides)
    randomize_constant_tensors(model)
    model.save_pretrained(directory)


def _roundtrip_worker(rank: int, world_size: int, cases: list[tuple], root: str) -> dict:
    """For each (model_type, tp, pp, ep, overrides): load the saved HF checkpoint sharded, gather it back.
    Every case of one run has the same layout: Megatron's parallel state is initialised once and reused."""
    from actorcore.mcore.checkpoint import load_hf_into_mcore
    from actorcore.mcore.weight_stream import gather_hf_state_dict
    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from transformers import AutoConfig

    results = {}
    with CpuRuntime():
        for model_type, tp, pp, ep, overrides in cases:
            directory = os.path.join(root, f"{model_type}-{sorted(overrides.items())}")
            parallel = McoreParallel(tp=tp, pp=pp, ep=ep)
            context = initialize_megatron(parallel)
            chunks = build_gpt_model(AutoConfig.from_pretrained(directory), parallel)
            load_hf_into_mcore(chunks, directory, context)
            results[(model_type, tp, pp, ep, tuple(sorted(overrides.items())))] = gather_hf_state_dict(chunks, context)
    return results


def _check(cases: list[tuple], world_size: int) -> None:
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as root:
        for model_type, _, _, _, overrides in cases:
            directory = os.path.join(root, f"{model_type}-{sorted(overrides.items())}")
            if not os.path.exists(directory):
                _save_tiny(model_type, directory, **overrides)
        results = run_distributed(_roundtrip_worker, world_size, args=(cases, root))
        for model_type, tp, pp, ep, overrides in cases:
            key = (model_type, tp, pp, ep, tuple(sorted(overrides.items())))
            reference = load_file(os.path.join(root, f"{model_type}-{sorted(overrides.items())}", "model.safetensors"))
            for rank_result in results:
                got = rank_result[key]
                assert sorted(got) == sorted(reference), f"{key}: names differ: {set(got) ^ set(reference)}"
                for name, tensor in reference.items():
                    assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (key, name)
                    assert torch.equal(got[name], tensor), f"{key}: {name} differs"


@pytest.mark.slow
def test_roundtrip_single_rank_every_arch():
    cases = [(m, 1, 1, 1, {}) for m in DENSE + MOE]
    cases.append(("qwen2", 1, 1, 1, {"tie_word_embeddings": True}))
    cases.append(("qwen2", 1, 1, 1, {"dtype": torch.bfloat16}))
    _check(cases, world_size=1)


@pytest.mark.slow
def test_roundtrip_tp2_every_arch():
    cases = [(m, 2, 1, 1, {}) for m in DENSE + MOE] + [("qwen2", 2, 1, 1, {"tie_word_embeddings": True})]
    _check(cases, world_size=2)


@pytest.mark.slow
def test_roundtrip_pp2_every_arch():
    cases = [(m, 1, 2, 1, {}) for m in DENSE + MOE] + [("qwen2", 1, 2, 1, {"tie_word_embeddings": True})]
    _check(cases, world_size=2)


@pytest.mark.slow
def test_roundtrip_ep2_moe():
    _check([(m, 1, 1, 2, {}) for m in MOE], world_size=2)


def _save_grouped(model_type: str, directory: str) -> None:
    """A checkpoint in transformers 5's in-memory layout: experts stacked in ``experts.gate_up_proj`` [E, 2I, D]
    and ``experts.down_proj`` [E, D, I] (what ``save_pretrained`` would convert back to per-expert tensors)."""
    from safetensors.torch import save_file

    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model(model_type, seed=4)
    randomize_constant_tensors(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    os.makedirs(directory)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)


def _grouped_worker(rank: int, world_size: int, root: str, model_types: list[str]) -> dict:
    from actorcore.mcore.checkpoint import load_hf_into_mcore
    from actorcore.mcore.weight_stream import gather_hf_state_dict
    from actorcore.mcore.cpu_runtime import CpuRuntime
    from actorcore.mcore.forward import compute_logprobs
    from actorcore.mcore.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.testing.reference import reference_logprobs, right_padded
    from transformers import AutoConfig, AutoModelForCausalLM

    import actorcore as ac

    out = {}
    sequences = [torch.arange(3, 3 + n) % 131 for n in (7, 12, 4)]
    batch = ac.pack(sequences)
    with CpuRuntime():
        for model_type in model_types:
            directory = os.path.join(root, model_type)
            parallel = McoreParallel(ep=2)
            context = initialize_megatron(parallel)
            chunks = build_gpt_model(AutoConfig.from_pretrained(directory), parallel)
            load_hf_into_mcore(chunks, directory, context)
            # The reference: the model's own forward (fp32, padded batch), not actorcore's HF route.
            hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
            with torch.no_grad():
                ref = reference_logprobs(hf, *right_padded(sequences))[0]
            got = compute_logprobs(chunks, batch, context).log_probs
            out[model_type] = (gather_hf_state_dict(chunks, context), got, ref)
    return out


@pytest.mark.slow
def test_grouped_expert_checkpoints_ep2():
    """Grouped-expert checkpoints load at EP=2 (each rank reads its rows), give the transformers forward's
    log-probs and export back bit-exact in the same grouped layout."""
    from safetensors.torch import load_file

    from actorcore.testing.tolerances import TOL

    from actorcore.archs import get_spec

    model_types = [m for m in MOE if get_spec(m).mcore.grouped_expert_rules]
    with tempfile.TemporaryDirectory() as root:
        for model_type in model_types:
            _save_grouped(model_type, os.path.join(root, model_type))
        results = run_distributed(_grouped_worker, 2, args=(root, model_types))
        for model_type in model_types:
            reference = load_file(os.path.join(root, model_type, "model.safetensors"))
            for result in results:
                state, got, ref = result[model_type]
                assert sorted(state) == sorted(reference), set(state) ^ set(reference)
                for name, tensor in reference.items():
                    assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
                torch.testing.assert_close(got, ref, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
