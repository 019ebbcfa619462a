"""What megatron-core asserts on, checked before anything is spawned or built: the HF config's sizes
(``actorcore.sizes.check_config_sizes``) and every way a tp / pp / vp / ep size must divide the model.

Why here: megatron-core checks these deep inside model construction, on every rank, with ``assert`` (an
``AssertionError`` with an empty message for ``--ep 3`` on 4 experts) or not at all until a shape breaks. Checked
from the HF config with the numbers the converter hands Megatron (``mcore_fields``), the user sees one line naming
the size, the model's count and what to choose, and ``actorcore convert`` refuses before any rank starts.
"""

from __future__ import annotations

from typing import Any

from actorcore.mcore.build.config import mcore_fields
from actorcore.mcore.parallel import McoreParallel
from actorcore.mcore.build.vlm import is_vlm_config, language_config
from actorcore.sizes import check_config_sizes


def _fitting(counts: list[int]) -> str:
    """The sizes that divide every one of ``counts``, for the message."""
    return ", ".join(str(d) for d in range(1, min(counts) + 1) if all(c % d == 0 for c in counts))


def check_layout(hf_config: Any, parallel: McoreParallel, *, vocab_multiple: int | None = None,
                 as_flags: bool = False) -> None:
    """Refuse (``ValueError`` naming the size and the sizes that fit) a config or layout megatron-core would assert
    on: config sizes, tp over the attention heads, key-value heads, MLP and shared-expert widths, linear-attention
    heads and ``vocab_multiple``; pp (and vp) over the layers; ep over the experts. ``as_flags``: name sizes as the
    CLI's flags (``--tp 3``) rather than as arguments (``tp=3``). A VLM config is checked by its language model."""
    check_config_sizes(hf_config)
    if is_vlm_config(hf_config):
        hf_config = language_config(hf_config)
    cfg, _ = mcore_fields(hf_config)

    def said(size: str) -> str:
        return f"--{size} {getattr(parallel, size)}" if as_flags else f"{size}={getattr(parallel, size)}"

    def choose(size: str, counts: list[int]) -> str:
        return f"the {'--' if as_flags else ''}{size} sizes that fit this model: {_fitting(counts)}"

    tp_counts = [("attention heads", cfg["num_attention_heads"]), ("key-value heads", cfg["num_query_groups"])]
    experts = cfg.get("num_moe_experts")
    if not experts or 0 in cfg.get("moe_layer_freq", [0]):  # dense MLP layers split their width over tp
        tp_counts.append(("MLP width (intermediate_size)", cfg.get("ffn_hidden_size")))
    tp_counts.append(("shared-expert width", cfg.get("moe_shared_expert_intermediate_size")))
    if any(cfg.get("linear_attention_freq") or ()):
        tp_counts += [("linear-attention key heads", cfg.get("linear_num_key_heads")),
                      ("linear-attention value heads", cfg.get("linear_num_value_heads"))]
    tp_counts = [(what, count) for what, count in tp_counts if count]
    for what, count in tp_counts:
        if count % parallel.tp:
            raise ValueError(f"{said('tp')} does not divide the model's {count} {what}: "
                             f"{choose('tp', [c for _, c in tp_counts])}")
    if vocab_multiple is not None and vocab_multiple % parallel.tp:
        name = "--vocab-multiple " if as_flags else "vocab_multiple="
        raise ValueError(f"{name}{vocab_multiple} must be divisible by {said('tp')}: use a multiple of {parallel.tp} "
                         "(the default, 128, suits every power-of-two tp)")
    layers = cfg["num_layers"]
    if layers % parallel.pp:
        raise ValueError(f"{said('pp')} does not divide the model's {layers} layers into equal pipeline stages: "
                         f"{choose('pp', [layers])}")
    if parallel.vp is not None and (layers // parallel.pp) % parallel.vp:
        per_stage = layers // parallel.pp
        raise ValueError(f"{said('vp')} does not divide the {per_stage} layers of each of the {parallel.pp} pipeline "
                         f"stages: {choose('vp', [per_stage])}")
    if parallel.ep > 1 and not experts:
        raise ValueError(f"{said('ep')}: {hf_config.model_type} has no experts to split (a dense model): use "
                         + ("--ep 1" if as_flags else "ep=1"))
    if experts and experts % parallel.ep:
        raise ValueError(f"{said('ep')} does not divide the model's {experts} experts: {choose('ep', [experts])}")
