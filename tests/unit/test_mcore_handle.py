"""The Megatron route's handle and sizes object without a Megatron world: ``McoreParallel``'s derived facts
(world check, context check, token multiple), ``McoreModel``'s validation and weight rules, and the verbs'
refusal of anything but an ``McoreModel``. Built models are tested over gloo in tests/dist/test_mcore_*.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actorcore.archs import get_spec
from actorcore.mcore.handle import McoreModel, require_model
from actorcore.mcore.parallel import McoreParallel
from actorcore.parallel.context import ParallelContext


def test_parallel_validates_and_owns_its_derived_facts():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        McoreParallel(tp=0)
    with pytest.raises(ValueError, match="vp=2 needs pp >= 2"):
        McoreParallel(vp=2)
    layout = McoreParallel(tp=2, cp=2, pp=2, ep=4)
    assert layout.world_size == 8
    layout.check_world(8)
    layout.check_world(16)
    with pytest.raises(ValueError, match="world size 12 does not fit tp=2 x cp=2 x pp=2 with ep=4"):
        layout.check_world(12)
    with pytest.raises(ValueError, match="world size 6 does not fit"):
        McoreParallel(tp=2, ep=4).check_world(6)  # tp=2 divides 6, ep=4 does not
    assert McoreParallel(tp=4).token_multiple(sequence_parallel=False) == 1
    assert McoreParallel(tp=4).token_multiple(sequence_parallel=True) == 4
    assert McoreParallel(cp=2).token_multiple(sequence_parallel=False) == 4
    assert McoreParallel(tp=2, cp=3).token_multiple(sequence_parallel=True) == 12


def test_parallel_refuses_a_context_of_other_sizes():
    context = SimpleNamespace(tp_size=2, pp_size=1, ep_size=1, cp_size=1)
    McoreParallel(tp=2).check_context(context)
    with pytest.raises(ValueError, match=r"tp=2 \(the layout has 1\)"):
        McoreParallel().check_context(context)


def _model(**fields) -> McoreModel:
    values = dict(chunks=[object()], hf_config=SimpleNamespace(model_type="qwen3_moe"),
                  spec=get_spec("qwen3_moe").mcore, parallel=McoreParallel(), context=ParallelContext())
    return McoreModel(**{**values, **fields})


def test_model_validates_its_fields():
    with pytest.raises(ValueError, match="non-empty list"):
        _model(chunks=[])
    with pytest.raises(ValueError, match="non-empty list"):
        _model(chunks=(object(),))
    with pytest.raises(ValueError, match="expert_layout must be one of"):
        _model(expert_layout="stacked")


def test_weight_rules_follow_the_expert_layout():
    config = SimpleNamespace(mtp_num_layers=None)
    chunk = SimpleNamespace(config=config)
    per_expert = _model(chunks=[chunk]).weight_rules
    grouped = _model(chunks=[chunk], expert_layout="grouped").weight_rules
    assert not per_expert.uses_grouped_experts and grouped.uses_grouped_experts
    assert per_expert == get_spec("qwen3_moe").mcore


@pytest.mark.parametrize("verb", ["load_hf_into_mcore", "compute_logprobs", "mcore_weight_stream"])
def test_verbs_refuse_anything_but_the_handle(verb):
    with pytest.raises(ValueError, match=f"{verb} takes the McoreModel that actorcore.mcore.build_gpt_model"):
        require_model([object()], verb)
    model = _model()
    assert require_model(model, verb) is model


def test_compute_logprobs_refuses_chunks():
    from actorcore.mcore.run.forward import compute_logprobs, compute_values

    with pytest.raises(ValueError, match="compute_logprobs takes the McoreModel"):
        compute_logprobs([object()], None)
    with pytest.raises(ValueError, match="compute_values takes the McoreModel"):
        compute_values([object()], None)
    with pytest.raises(ValueError, match="needs a critic"):
        compute_values(_model(), None)


def test_expert_layout_is_read_from_the_checkpoint_and_checked_at_load(tmp_path):
    """A checkpoint's expert layout (per expert, as ``save_pretrained`` writes; stacked, as transformers 5 holds
    them in memory) is read before building; loading one into a model built for the other layout is refused."""
    from safetensors.torch import save_file

    from actorcore.errors import CheckpointMismatchError
    from actorcore.mcore.convert.load import _checkpoint_rules, checkpoint_expert_layout
    from actorcore.testing.tiny_configs import build_tiny_model

    hf = build_tiny_model("qwen3_moe", seed=1)
    hf.save_pretrained(str(tmp_path / "per_expert"))
    (tmp_path / "grouped").mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "grouped" / "model.safetensors"), metadata={"format": "pt"})
    assert checkpoint_expert_layout(str(tmp_path / "per_expert"), hf.config) == "per_expert"
    assert checkpoint_expert_layout(str(tmp_path / "grouped"), hf.config) == "grouped"
    chunk = SimpleNamespace(config=SimpleNamespace(mtp_num_layers=None))
    assert _checkpoint_rules(_model(chunks=[chunk], expert_layout="grouped"), set(state), "d").uses_grouped_experts
    with pytest.raises(CheckpointMismatchError, match=r"stacked per layer .* build_gpt_model\(\.\.\., "
                                                      r"expert_layout='grouped'\)"):
        _checkpoint_rules(_model(chunks=[chunk]), set(state), "d")
