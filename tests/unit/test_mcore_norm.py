"""``SequenceParallelTorchNorm`` and the spec rewrite that puts it in Megatron's local layer spec."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=2,
                  sequence_parallel=True, normalization="RMSNorm", use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


@pytest.mark.parametrize("normalization,cls", [("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_norm_is_the_torch_norm_with_its_parameters_marked(normalization, cls, sequence_parallel):
    from actorcore.mcore.build.norm import SequenceParallelTorchNorm

    norm = SequenceParallelTorchNorm(_config(normalization=normalization, sequence_parallel=sequence_parallel),
                                     48, eps=3e-4)
    assert type(norm) is cls and norm.eps == 3e-4 and tuple(norm.weight.shape) == (48,)
    assert [p.sequence_parallel for p in norm.parameters()] == [sequence_parallel] * len(list(norm.parameters()))


def test_norm_refuses_fused_only_options():
    from actorcore.mcore.build.norm import SequenceParallelTorchNorm

    with pytest.raises(ValueError, match="persist_layer_norm=True needs a fused norm"):
        SequenceParallelTorchNorm(_config(persist_layer_norm=True), 64)


def _classes(node, seen=None) -> list:
    """Every class reachable in a spec tree."""
    seen = [] if seen is None else seen
    if isinstance(node, type):
        seen.append(node)
    elif isinstance(node, (list, tuple)):
        for item in node:
            _classes(item, seen)
    elif dataclasses.is_dataclass(node):
        for field in dataclasses.fields(node):
            _classes(getattr(node, field.name), seen)
    return seen


def test_spec_rewrite_replaces_every_local_norm_and_nothing_else():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from actorcore.mcore.build.norm import SequenceParallelTorchNorm, with_sequence_parallel_norms

    spec = get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm")
    before = _classes(spec)
    after = _classes(with_sequence_parallel_norms(spec))
    # input, q, k and pre-MLP norms
    assert before.count(WrappedTorchNorm) == 4 and WrappedTorchNorm not in after
    assert after.count(SequenceParallelTorchNorm) == 4
    assert [c for c in after if c is not SequenceParallelTorchNorm] == [c for c in before if c is not WrappedTorchNorm]
    assert WrappedTorchNorm in _classes(spec)  # the input spec is left as it was
