"""CUDA: every pair of ``patch_model`` options (and a batch-invariant call) on a bf16 model, the GPU-only values
included (the compiled decoder, quack's gated MLP where quack runs, the ``torch_varlen`` and ``fa4`` attention backends
where they run): each works as asked, per token and per gradient
against the same weights' own forward in fp32 with the trace proving each requested feature ran, or is refused
before any work (``support.option_pairs``: the CPU test ``tests/unit/test_patch_plan.py`` runs the same
table with the GPU-only values refused). Skipped without CUDA / triton."""

from __future__ import annotations

import copy

import pytest
import torch

from support.option_pairs import (
    REFUSED,
    Tolerances,
    backend_refusals,
    checkpointed,
    model_type_for,
    option_pairs,
    own_forward,
    run_pair,
    sequences,
)
from actorcore.testing.tiny_configs import build_tiny_model
from actorcore.testing.tolerances import TOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def models():
    """Per kind: the bf16 CUDA model (its own gradient checkpointing on), its weights' own fp32 forward, and the bf16
    model's own forward (the allowance of a parameter whose bf16 gradient is already far from fp32: the MoE routers,
    where bf16 flips a token's top-k choice)."""
    pytest.importorskip("triton")
    torch.backends.cuda.matmul.allow_tf32 = False
    built = {}
    for model_type in {model_type_for(pair) for pair in option_pairs()}:
        fp32 = checkpointed(build_tiny_model(model_type, seed=11).cuda())
        want = own_forward(copy.deepcopy(fp32), sequences())
        bf16 = fp32.to(torch.bfloat16)
        built[model_type] = (bf16, want, own_forward(copy.deepcopy(bf16), sequences()))
    yield built
    torch.backends.cuda.matmul.allow_tf32 = True


def _refusals(model: torch.nn.Module) -> dict:
    from actorcore.hf.features.attention import module_head_dim
    from actorcore.kernels.attention.backends import backend_refusal
    from actorcore.kernels.quack.runtime import quack_refusal

    refused = dict(REFUSED)
    if quack_refusal() is not None:  # no Hopper GPU or no quack here: quack's gated MLP is refused, not run
        for pair in option_pairs():
            if "swiglu_mlp" in pair and frozenset(pair) not in refused:
                refused[frozenset(pair)] = "swiglu_mlp='quack'"
    # An attention backend that cannot run here (FA4 off Hopper or without flash-attn-4) is refused first.
    head_dim = module_head_dim(model.model.layers[0].self_attn)
    cannot = {ask: f"attention_backend='{ask}'" for ask in ("torch_varlen", "fa4")
              if backend_refusal(ask, torch.device("cuda"), torch.bfloat16, head_dim=head_dim) is not None}
    refused.update(backend_refusals(option_pairs(), cannot))
    return refused


@pytest.mark.parametrize("pair", option_pairs(), ids="+".join)
def test_every_pair_works_as_asked_or_is_refused_on_cuda(models, pair):
    import actorcore as ac

    model, want, own_bf16 = models[model_type_for(pair)]
    refused = _refusals(model).get(frozenset(pair))
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            run_pair(model, pair, sequences(), want, Tolerances(1, 1))
        assert not ac.hf.patch.is_patched(model)
        return
    run_pair(model, pair, sequences(), want,
             Tolerances(TOL["options_bf16_cuda_vs_fp32"], TOL["grad_bf16_vs_fp32_rel_norm"], grad_by_norm=True,
                        own_16bit=own_bf16, own_factor=TOL["grad_bf16_vs_own_bf16_factor"]))
