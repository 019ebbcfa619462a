"""The top level of ``actorcore`` is the contract of DESIGN.md, and the names it had before keep working for one
release with a DeprecationWarning that names their new place."""

import importlib
import re
import subprocess
import sys
import warnings

import pytest

import actorcore as ac

CONTRACT = {
    "PackedBatch", "pack", "pack_padded", "unpack",
    "compute_logprobs", "compute_values", "compute_loss", "compute_logprobs_padded", "LogProbOutput", "LossOutput",
    "patch_model", "PatchHandle", "ParallelContext",
    "verify", "VerifyReport", "register_arch", "get_spec", "registered_model_types",
    "linear_logprob_entropy", "linear_logprob_loss",
    "UnsupportedArchitectureError", "VerificationError", "NonFiniteError", "FastPathNotRunError",
}


def test_top_level_is_the_contract():
    assert set(ac.__all__) == CONTRACT
    assert set(dir(ac)) == CONTRACT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in CONTRACT:
            assert getattr(ac, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        ac.no_such_name


def test_import_loads_no_route():
    code = ("import sys, actorcore; heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('transformers', 'megatron')]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loss_output_lives_beside_logprob_output():
    from actorcore.kernels.logprob import LossOutput as kernel_loss_output
    from actorcore.outputs import LossOutput

    assert ac.LossOutput is LossOutput is kernel_loss_output


@pytest.mark.parametrize("name", sorted(ac._DEPRECATED))
def test_removed_names_warn_and_name_their_new_place(name):
    module, instead = ac._DEPRECATED[name]
    assert name not in ac.__all__
    with pytest.warns(DeprecationWarning, match=f"actorcore.{name} is deprecated.*use {re.escape(instead)}"):
        value = getattr(ac, name)
    assert value is getattr(importlib.import_module(module), name)
    if instead.startswith(f"{module}.{name}"):
        return
    # A removed second door: the call it names is the top-level one that already does the same.
    assert instead.split("(")[0] in {f"actorcore.{n}" for n in CONTRACT}


def test_from_import_of_a_removed_name_warns():
    with pytest.warns(DeprecationWarning, match="use actorcore.export.hf_weight_stream"):
        from actorcore import hf_weight_stream
    from actorcore.export import hf_weight_stream as new

    assert hf_weight_stream is new


# The Megatron route's module paths from before mcore/ was split into build/, run/ and convert/ (those its public
# names lived in, and those the docs named): kept for one release.
MOVED_MCORE_MODULES = {"config": "build", "model": "build", "norm": "build", "attention": "build", "rotary": "build",
                       "forward": "run", "load": "convert", "weight_stream": "convert", "dist_checkpoint": "convert"}


@pytest.mark.parametrize("name,room", sorted(MOVED_MCORE_MODULES.items()))
def test_megatron_module_paths_from_before_the_rooms_import_with_a_warning(name, room, monkeypatch):
    old, new = f"actorcore.mcore.{name}", f"actorcore.mcore.{room}.{name}"
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} moved to {re.escape(new)}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_megatron_public_names_resolve_from_the_package():
    import actorcore.mcore as mcore

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the package's names come from the new paths
        for name in mcore.__all__:
            assert getattr(mcore, name) is not None, name


def test_renamed_options_still_work_for_one_release_with_a_warning():
    """``fused_decoder`` is ``compiled_decoder`` and ``dense_mlp`` is ``swiglu_mlp`` (keywords and plan names), and
    ``moe_experts="grouped"`` is ``"sorted"``: the old ones give the same plan, with a DeprecationWarning; both names
    at once are refused."""
    from actorcore.testing.tiny_configs import build_tiny_model

    model = build_tiny_model("qwen2_moe")
    with pytest.warns(DeprecationWarning, match=r"patch_model\(fused_decoder=...\) was renamed compiled_decoder"):
        handle = ac.patch_model(model, fused_decoder=False, dense_mlp=False)
    with pytest.warns(DeprecationWarning, match="'fused_decoder' was renamed 'compiled_decoder'"):
        assert handle.plan["fused_decoder"] is handle.plan["compiled_decoder"]
    assert handle.plan["compiled_decoder"].explicit and handle.plan["swiglu_mlp"].explicit
    handle.revert()
    with pytest.warns(DeprecationWarning, match="moe_experts='grouped' was renamed moe_experts='sorted'"):
        handle = ac.patch_model(model, moe_experts="grouped")
    assert handle.plan.value("moe_experts") == "sorted" and handle.state.targets("moe_experts")
    handle.revert()
    with pytest.raises(TypeError, match="fused_decoder= and compiled_decoder="), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ac.patch_model(model, fused_decoder=False, compiled_decoder=False)


@pytest.mark.parametrize("old,new", [("fused_decoder", "compiled_decoder"), ("dense_mlp", "swiglu_mlp")])
def test_renamed_feature_modules_import_with_a_warning(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, f"actorcore.hf.features.{old}", raising=False)
    with pytest.warns(DeprecationWarning, match=f"actorcore.hf.features.{old} moved to actorcore.hf.features.{new}"):
        module = importlib.import_module(f"actorcore.hf.features.{old}")
    assert module is importlib.import_module(f"actorcore.hf.features.{new}")


def test_renamed_rule_tables_and_error_classes():
    import actorcore.archs.megatron_rules as rules
    from actorcore.errors import FastPathNotRunError, PackingNotAppliedError, PatchNotAppliedError

    with pytest.warns(DeprecationWarning, match="SHARED_EXPERT_RULES was renamed QWEN_SHARED_EXPERT_RULES"):
        assert rules.SHARED_EXPERT_RULES is rules.QWEN_SHARED_EXPERT_RULES
    with pytest.warns(DeprecationWarning, match="SHARED_EXPERTS_RULES was renamed DEEPSEEK_SHARED_EXPERTS_RULES"):
        assert rules.SHARED_EXPERTS_RULES is rules.DEEPSEEK_SHARED_EXPERTS_RULES
    # a patch that did not run is a fast path that did not run, not a packing error
    assert issubclass(PatchNotAppliedError, FastPathNotRunError)
    assert not issubclass(PatchNotAppliedError, PackingNotAppliedError)
