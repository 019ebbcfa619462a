"""Hybrid (Gated DeltaNet) models on the Megatron route: a tiny model, its sequences and the transformers reference."""

from __future__ import annotations

import torch


LENGTHS = [(5, 11, 3, 9), (14, 2, 7)]


def hybrid_sequences() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [[torch.randint(3, 131, (n,), generator=gen) for n in lengths] for lengths in LENGTHS]


def tiny_hf(model_type: str, leak: str | None = None):
    """The seeded tiny model (norm weights and other constants randomised). ``leak="conv"``: every layer linear
    attention with a decay so strong that the delta-rule state forgets each token at once (only the conv reaches
    other tokens); ``leak="delta_rule"``: every layer linear attention with a conv of one tap (only the delta-rule
    state reaches other tokens, decaying slowly so that a leak would show)."""
    from support.mcore_weights import randomize_constant_tensors

    from actorcore.testing.tiny_configs import build_tiny_model

    overrides = {} if leak is None else {"layer_types": ["linear_attention", "linear_attention"]}
    if leak is not None and model_type == "qwen3_next":
        overrides["mlp_only_layers"] = [1]
    model = build_tiny_model(model_type, seed=5, **overrides)
    randomize_constant_tensors(model, seed=1)
    if leak is None:
        return model
    with torch.no_grad():
        for layer in model.model.layers:
            gdn = layer.linear_attn
            if leak == "conv":
                gdn.A_log.fill_(9.0)      # g = -exp(9) * softplus(a + 20) ~ -1.6e5: exp(g) == 0
                gdn.dt_bias.fill_(20.0)
            elif leak == "delta_rule":
                gdn.conv1d.weight[..., :-1] = 0.0  # only the current token's tap
                gdn.A_log.fill_(-3.0)  # a slow decay (exp(-3) * softplus(.)): the state remembers far back
    return model


def hybrid_reference(model, sequences):
    from actorcore.testing.reference import reference_logprobs, right_padded

    return reference_logprobs(model, *right_padded(sequences))
