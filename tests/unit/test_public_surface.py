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
