"""Refusals of ``overlap_moe_expert_parallel_comm=True`` (Megatron's combined 1F1B schedule), raised by
``build_gpt_model`` before Megatron's parallel state is read: each names what is missing. That it runs and equals
the plain schedule where it is allowed is tested on gloo (tests/dist/test_mcore_glm4_moe.py)."""

from __future__ import annotations

import pytest
import torch

from actorcore.errors import UnsupportedConfigError

pytest.importorskip("megatron.core")

OPTION = {"overlap_moe_expert_parallel_comm": True}


def _build(model_type: str, dtype: torch.dtype = torch.bfloat16, **kwargs):
    from actorcore.mcore.build.model import build_gpt_model
    from actorcore.mcore.parallel import McoreParallel
    from actorcore.testing.tiny_configs import tiny_config

    parallel = McoreParallel(**{"ep": 2, **kwargs.pop("parallel", {})})
    return build_gpt_model(tiny_config(model_type), parallel, dtype, **kwargs)


@pytest.mark.parametrize("model_type, dtype, kwargs, needs", [
    ("glm4_moe", torch.float32, OPTION, "a bf16 or fp16 model"),
    ("glm4_moe", torch.bfloat16, {**OPTION, "parallel": {"ep": 1}}, "expert parallelism (ep >= 2, got ep=1)"),
    ("glm4_moe", torch.bfloat16, {**OPTION, "parallel": {"pp": 2}}, "pp = 1 (got pp=2)"),
    ("glm4_moe", torch.bfloat16, {**OPTION, "parallel": {"cp": 2}}, "cp = 1 (got cp=2)"),
    ("glm4_moe", torch.bfloat16, {**OPTION, "mtp": True}, "no MTP layers"),
    # mlp_only_layers=[1]: the last layer is dense, after which megatron's plan skips the final norm.
    ("qwen3_moe", torch.bfloat16, OPTION, "a MoE last decoder layer"),
])
def test_refused_naming_what_is_missing(model_type, dtype, kwargs, needs):
    with pytest.raises(UnsupportedConfigError, match="overlap_moe_expert_parallel_comm=True") as info:
        _build(model_type, dtype, **kwargs)
    assert needs in str(info.value)


def test_allowed_layout_passes_the_checks():
    """glm4_moe (dense first layer, MoE last) in bf16 at EP=2: no refusal; the build then stops only because
    Megatron's parallel state is not initialised here."""
    with pytest.raises(ValueError, match="parallel state is not initialised") as info:
        _build("glm4_moe", torch.bfloat16, **OPTION)
    assert not isinstance(info.value, UnsupportedConfigError)
