"""HF -> Megatron (sharded over TP / PP / EP) -> HF is bit-exact for every Megatron architecture (gloo, CPU).

Every two-rank case runs in one spawn (the module-scoped ``world2``); each test asserts its own layout's results."""

from __future__ import annotations

import os

import pytest
import torch

from support.mcore_cases import spawn_cases, stapled_attributes
from support.mcore_weights import randomize_constant_tensors


pytest.importorskip("megatron.core")


def _archs() -> tuple[list[str], list[str]]:
    """(dense, MoE) Megatron architectures, from the registry (MoE: a spec with per-expert rules)."""
    from actorcore.archs import get_spec
    from actorcore.mcore.build.model import megatron_model_types

    moe = [m for m in megatron_model_types() if any(r.parallel == "expert" for r in get_spec(m).mcore.rules)]
    return [m for m in megatron_model_types() if m not in moe], moe


DENSE, MOE = _archs()


def _save_tiny(model_type: str, directory: str, **overrides) -> None:
    from actorcore.archs import get_spec
    from actorcore.testing.tiny_configs import build_tiny_model
    from actorcore.testing.tiny_vlm import build_tiny_vlm

    build = build_tiny_vlm if get_spec(model_type).vision is not None else build_tiny_model  # VLM: tower too
    model = build(model_type, seed=3, **overrides)
    randomize_constant_tensors(model)
    if model_type == "kimi_k25":  # under the release's names, which the Megatron route exports
        from support.kimi_release import save_release_checkpoint

        save_release_checkpoint(model, directory)
    else:
        model.save_pretrained(directory)


def _layout_case(tp: int, pp: int, ep: int, entries: list[tuple[str, dict]], root: str) -> dict:
    """Under one layout, for each (model_type, overrides): load the saved HF checkpoint sharded, gather it back."""
    from actorcore.mcore.convert.load import load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict
    from transformers import AutoConfig

    parallel = McoreParallel(tp=tp, pp=pp, ep=ep)
    initialize_megatron(parallel)
    results = {}
    for model_type, overrides in entries:
        directory = _directory(root, model_type, overrides)
        model = build_gpt_model(AutoConfig.from_pretrained(directory), parallel)
        load_hf_into_mcore(model, directory)
        assert not stapled_attributes(model), stapled_attributes(model)
        results[(model_type, tuple(sorted(overrides.items())))] = gather_hf_state_dict(model)
    return results


def _directory(root: str, model_type: str, overrides: dict) -> str:
    return os.path.join(root, f"{model_type}-{sorted(overrides.items())}")


def _layout_cases(root: str, layouts: dict[str, tuple[int, int, int, list[tuple[str, dict]]]]) -> list[tuple]:
    """The spawn's cases, one per layout, with every checkpoint they read saved under ``root``."""
    for *_sizes, entries in layouts.values():
        for model_type, overrides in entries:
            if not os.path.exists(_directory(root, model_type, overrides)):
                _save_tiny(model_type, _directory(root, model_type, overrides), **overrides)
    return [(name, _layout_case, (tp, pp, ep, entries, root)) for name, (tp, pp, ep, entries) in layouts.items()]


def _check(results: list[dict], entries: list[tuple[str, dict]], root: str) -> None:
    from safetensors.torch import load_file

    for model_type, overrides in entries:
        key = (model_type, tuple(sorted(overrides.items())))
        reference = load_file(os.path.join(_directory(root, model_type, overrides), "model.safetensors"))
        for rank_result in results:
            got = rank_result[key]
            assert sorted(got) == sorted(reference), f"{key}: names differ: {set(got) ^ set(reference)}"
            for name, tensor in reference.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, (key, name)
                assert torch.equal(got[name], tensor), f"{key}: {name} differs"


SINGLE = [(m, {}) for m in DENSE + MOE] + [("qwen2", {"tie_word_embeddings": True}),
                                           ("qwen2", {"dtype": torch.bfloat16})]
SHARDED = [(m, {}) for m in DENSE + MOE] + [("qwen2", {"tie_word_embeddings": True})]
# The two-rank layouts, all in one spawn (``world2``).
LAYOUTS2 = {"tp2": (2, 1, 1, SHARDED), "pp2": (1, 2, 1, SHARDED), "ep2": (1, 1, 2, [(m, {}) for m in MOE])}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """Every two-rank case of this file in one spawn: the TP, PP and EP round trips and the grouped checkpoints."""
    from actorcore.archs import get_spec

    root = str(tmp_path_factory.mktemp("mcore_roundtrip2"))
    cases = _layout_cases(root, LAYOUTS2)
    # Architectures with both layouts (a grouped-only one, gpt-oss, is the plain round trip above).
    grouped = [m for m in MOE if get_spec(m).mcore.grouped_expert_rules and not get_spec(m).mcore.uses_grouped_experts]
    for model_type in grouped:
        _save_grouped(model_type, os.path.join(root, "grouped", model_type))
    cases.append(("grouped_ep2", _grouped_case, (os.path.join(root, "grouped"), grouped)))
    return {"root": root, "grouped": grouped, **spawn_cases(2, cases)}


@pytest.mark.slow
def test_roundtrip_single_rank_every_arch(tmp_path):
    results = spawn_cases(1, _layout_cases(str(tmp_path), {"single": (1, 1, 1, SINGLE)}))
    _check(results["single"], SINGLE, str(tmp_path))


@pytest.mark.slow
def test_roundtrip_tp2_every_arch(world2):
    _check(world2["tp2"], SHARDED, world2["root"])


@pytest.mark.slow
def test_roundtrip_pp2_every_arch(world2):
    _check(world2["pp2"], SHARDED, world2["root"])


@pytest.mark.slow
def test_roundtrip_ep2_moe(world2):
    _check(world2["ep2"], LAYOUTS2["ep2"][3], world2["root"])


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


def _grouped_case(root: str, model_types: list[str]) -> dict:
    from actorcore.mcore.run.forward import compute_logprobs
    from actorcore.mcore.convert.load import checkpoint_expert_layout, load_hf_into_mcore
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel, initialize_megatron
    from actorcore.mcore.convert.weight_stream import gather_hf_state_dict
    from actorcore.testing.reference import reference_logprobs, right_padded
    from transformers import AutoConfig, AutoModelForCausalLM

    import actorcore as ac

    out = {}
    sequences = [torch.arange(3, 3 + n) % 131 for n in (7, 12, 4)]
    batch = ac.pack(sequences)
    parallel = McoreParallel(ep=2)
    initialize_megatron(parallel)
    for model_type in model_types:
        directory = os.path.join(root, model_type)
        config = AutoConfig.from_pretrained(directory)
        layout = checkpoint_expert_layout(directory, config)
        model = build_gpt_model(config, parallel, expert_layout=layout)
        load_hf_into_mcore(model, directory)
        try:  # the same checkpoint under a model built for the other layout: refused, saying what to build
            load_hf_into_mcore(build_gpt_model(config, parallel), directory)
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        # The reference: the model's own forward (fp32, padded batch), not actorcore's HF route.
        hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
        with torch.no_grad():
            ref = reference_logprobs(hf, *right_padded(sequences))[0]
        got = compute_logprobs(model, batch).log_probs
        out[model_type] = (gather_hf_state_dict(model), got, ref, layout, refused)
    return out


@pytest.mark.slow
def test_grouped_expert_checkpoints_ep2(world2):
    """Grouped-expert checkpoints load at EP=2 (each rank reads its rows) into a model built for that layout, give
    the transformers forward's log-probs and export back bit-exact in the same grouped layout; a model built for
    per-expert tensors refuses them."""
    from safetensors.torch import load_file

    from actorcore.testing.tolerances import TOL

    assert world2["grouped"]
    for model_type in world2["grouped"]:
        reference = load_file(os.path.join(world2["root"], "grouped", model_type, "model.safetensors"))
        for result in world2["grouped_ep2"]:
            state, got, ref, layout, refused = result[model_type]
            assert layout == "grouped"
            assert "expert_layout='grouped'" in refused, refused
            assert sorted(state) == sorted(reference), set(state) ^ set(reference)
            for name, tensor in reference.items():
                assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
            torch.testing.assert_close(got, ref, atol=TOL["mcore_vs_hf_fp32"], rtol=0)
