"""``register_arch``: add an architecture from user code, proven first on a tiny model of its config.

The spec is tried on a seeded random-weight model of the user's config, shrunk to a few layers and a small
width with every other field kept (the multipliers, softcaps and scalings that a default config would hide),
and registered only if ``verify`` finds actorcore's per-token log-probs and entropies equal to the model's own
``...ForCausalLM.forward``.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from actorcore.archs import ArchSpec, registry

logger = logging.getLogger(__name__)

# Sizes of the tiny model a spec is proven on (the test suite's tiny configs use the same).
TINY_SIZES: dict[str, int] = dict(hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=131, moe_intermediate_size=40,
                                  shared_expert_intermediate_size=24, num_experts=4, num_local_experts=4,
                                  n_routed_experts=4, num_experts_per_tok=2, linear_num_key_heads=2,
                                  linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12)
TINY_SEQUENCE_LENGTHS = (1, 7, 23, 12)


def shrink_config(config: Any) -> Any:
    """A copy of ``config`` with the sizes of ``TINY_SIZES`` (only where it has those fields), its per-layer
    lists cut to the new depth (deep enough for one layer of each kind in ``layer_types``: a hybrid model keeps a
    linear-attention and a full-attention layer), and every other field unchanged."""
    tiny = copy.deepcopy(config)
    for name, value in TINY_SIZES.items():
        if getattr(tiny, name, None) is not None:
            setattr(tiny, name, value)
    layers = tiny.num_hidden_layers
    if isinstance(getattr(tiny, "layer_types", None), (list, tuple)):
        types = list(tiny.layer_types)
        kinds = list(dict.fromkeys(types))
        if not set(kinds) <= set(types[:layers]):  # the first layers miss a kind: one of each, in order of first use
            layers = tiny.num_hidden_layers = max(layers, len(kinds))
            types = kinds + types
        tiny.layer_types = types[:layers]
    if isinstance(getattr(tiny, "mlp_only_layers", None), (list, tuple)):
        tiny.mlp_only_layers = [i for i in tiny.mlp_only_layers if i < layers]
    if getattr(tiny, "first_k_dense_replace", None):
        tiny.first_k_dense_replace = min(tiny.first_k_dense_replace, layers - 1)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token = getattr(tiny, name, None)
        if isinstance(token, int) and token >= tiny.vocab_size:
            setattr(tiny, name, None)
    return tiny


def _tiny_model(config: Any, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - any construction failure is reported with what to do
        raise ValueError(f"could not build a tiny {config.model_type} model to prove the spec on ({err}); pass a "
                         "small config yourself with shrink=False") from err
    return model.eval()


def register_arch(spec: ArchSpec, config: Any, *, shrink: bool = True, replace: bool = False,
                  seed: int = 0) -> Any:
    """Register ``spec`` after proving it on a tiny random model of ``config`` (the architecture's real config,
    e.g. ``AutoConfig.from_pretrained(local_dir)``); returns the passing verification report.

    Raises ``VerificationError`` (nothing is registered) when actorcore's outputs differ from the model's own
    forward, ``UnsupportedArchitectureError`` when the config uses a head transform the spec does not declare.
    """
    from actorcore.batch import pack
    from actorcore.hf.verify import verify

    if not isinstance(spec, ArchSpec):
        raise ValueError(f"register_arch takes an actorcore.archs.ArchSpec, got {type(spec).__name__}")
    if getattr(config, "model_type", None) != spec.model_type:
        raise ValueError(f"config has model_type {getattr(config, 'model_type', None)!r} but the spec is for "
                         f"{spec.model_type!r}")
    table = registry()
    previous = table.find(spec.model_type)
    table.add(spec, replace=replace)
    try:
        model = _tiny_model(shrink_config(config) if shrink else config, seed)
        g = torch.Generator().manual_seed(seed)
        vocab = model.get_input_embeddings().num_embeddings
        batch = pack([torch.randint(0, vocab, (n,), generator=g) for n in TINY_SEQUENCE_LENGTHS])
        report = verify(model, batch, temperature=0.7, strict=True)
    except BaseException:
        table.remove(spec.model_type, restore=previous)
        raise
    logger.info("registered architecture %s (verified: max |d log-prob| %.2e)", spec.model_type,
                report.max_abs_diff_logprob)
    return report
