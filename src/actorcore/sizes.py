"""Sizes a user hands in, checked in one place: a byte budget, a GiB budget, a time-out (``positive_size``) and the
size fields of a Hugging Face config (``check_config_sizes``).

Why one helper: ``x <= 0`` lets NaN through (every comparison with NaN is False: a NaN bucket bound streamed the
whole model as one bucket), and a string such as ``"1GB"`` fails later with a ``TypeError`` that names no argument.
Here a size is refused unless it is of the right type, finite and positive, with a message that names the argument
and what to pass. A config field the same way: Megatron-Core asserts on some (an empty ``AssertionError``), others
end in ``ZeroDivisionError`` or "math domain error"; checked here they are one line naming the field.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Callable


def _shown(value: Any) -> str:
    plain = isinstance(value, (int, float)) and not isinstance(value, bool)
    return repr(value) if plain else f"{value!r} (a {type(value).__name__})"


def positive_size(name: str, value: Any, *, unit: str = "bytes", integer: bool = True,
                  hint: str = "pass e.g. 512 * 1024**2 for 512 MiB") -> Any:
    """``value`` as a finite positive size (an ``int`` when ``integer``, else a ``float``), or ``ValueError``
    naming ``name``, the ``unit`` and what to do (``hint``). ``bool`` is never a size."""
    kind = "int" if integer else "finite number"
    refusal = ValueError(f"{name} must be a positive {kind}{f' of {unit}' if unit else ''}, got {_shown(value)}"
                         + (f": {hint}" if hint else ""))
    if isinstance(value, bool):
        raise refusal
    if integer:
        try:
            number = operator.index(value)  # int and numpy integers; never a float, a string or a tensor
        except TypeError:
            raise refusal from None
    elif isinstance(value, numbers.Real):
        number = float(value)
    else:
        raise refusal
    if not (math.isfinite(number) and number > 0):
        raise refusal
    return number


# Size fields of a Hugging Face config that must be positive ints where present (None: the field is unused).
POSITIVE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "vocab_size", "intermediate_size", "moe_intermediate_size", "num_experts_per_tok")
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
FIX = "fix the config"


def _field_reader(config: Any) -> tuple[Callable[[str], Any], str]:
    """A reader of the language model's fields (a dict, e.g. a raw ``config.json``, or a config object) and how
    to name the config in a message."""
    if isinstance(config, dict):
        text = config.get("text_config")
        fields = text if isinstance(text, dict) else config
        where = "config.json" + ("'s text_config" if fields is not config else "")
        return fields.get, where
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (lambda field: getattr(text, field, None)), f"the {getattr(config, 'model_type', 'model')} config"


def check_config_sizes(config: Any) -> None:
    """Refuse a config whose sizes no model can have, naming the field and what to fix, before transformers or
    Megatron-Core meet it: layer, head, width and vocabulary counts positive ints; query heads a multiple of the
    key-value heads; a mixture of experts choosing at most its experts, and grouped routing (``n_group`` /
    ``topk_group``) that splits the experts evenly and can reach ``num_experts_per_tok`` of them. ``config``: a
    transformers config or the dict of a ``config.json`` (a VLM's ``text_config`` is what is checked)."""
    get, where = _field_reader(config)
    for field in POSITIVE_FIELDS:
        if get(field) is not None:
            positive_size(f"{where}: {field}", get(field), unit="", hint=FIX)
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} "
                         "(each key-value head serves a whole group of query heads): fix the config")
    experts = next((get(f) for f in EXPERT_COUNT_FIELDS if get(f) is not None), None)
    if not experts:  # a dense model (some configs carry 0 or None)
        return
    experts = positive_size(f"{where}: the number of experts", experts, unit="", hint=FIX)
    top_k = get("num_experts_per_tok")
    if top_k is not None and top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok={top_k} is more than the model's {experts} experts: each "
                         f"token chooses at most {experts}; fix the config")
    _check_expert_groups(get, where, experts, top_k)


def _check_expert_groups(get: Callable[[str], Any], where: str, experts: int, top_k: Any) -> None:
    groups, group_top_k = get("n_group"), get("topk_group")
    if groups is None:
        return
    groups = positive_size(f"{where}: n_group", groups, unit="", hint="fix the config (1: no expert groups)")
    if experts % groups:
        raise ValueError(f"{where}: n_group={groups} does not divide the model's {experts} experts into equal groups: "
                         f"choose an n_group that divides {experts}")
    if group_top_k is None:
        return
    group_top_k = positive_size(f"{where}: topk_group", group_top_k, unit="", hint=FIX)
    if group_top_k > groups:
        raise ValueError(f"{where}: topk_group={group_top_k} is more than n_group={groups} (the groups a token may "
                         "choose from): fix the config")
    if top_k is not None and top_k > group_top_k * (experts // groups):
        raise ValueError(f"{where}: num_experts_per_tok={top_k} is more than the {group_top_k * (experts // groups)} "
                         f"experts of the topk_group={group_top_k} groups a token may choose (of {experts // groups} "
                         "experts each): fix the config")
