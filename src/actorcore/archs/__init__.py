"""Registry of architecture specs: one module per ``model_type`` in this package, plus ``register_arch``.

Adding an architecture = one ``archs/<model_type>.py`` defining ``SPEC`` + one tiny config in the tests
(``actorcore.testing.tiny_configs``); or, from user code, ``actorcore.register_arch(spec, config)``, which
first proves the spec on a tiny model of that config (``actorcore.hf.register``). Nothing here is hand-synced.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any

from actorcore.archs.spec import (
    HEAD_CONFIG_FIELDS,
    ArchSpec,
    HeadTransform,
    LinearAttentionSpec,
    UnsupportedArchitectureError,
    submodule,
)

__all__ = ["ArchSpec", "HeadTransform", "LinearAttentionSpec", "Registry", "UnsupportedArchitectureError",
           "check_config", "get_spec", "registered_model_types", "spec_for_model", "submodule", "text_config"]

_NOT_SPECS = {"spec", "megatron_rules", "support", "table"}


class Registry:
    """``model_type`` -> ``ArchSpec``: the specs shipped in this package, and those users register.

    The one registry object is the process-wide table that ``register_arch`` adds to, as transformers'
    ``AttentionInterface`` is: an explicit, user-invoked registration, never a switch flipped on import.
    """

    def __init__(self, specs: dict[str, ArchSpec]) -> None:
        self._specs: dict[str, ArchSpec] = {}
        for spec in specs.values():
            self.add(spec)

    def add(self, spec: ArchSpec, replace: bool = False) -> None:
        if not isinstance(spec, ArchSpec):
            raise ValueError(f"register an actorcore.archs.ArchSpec, got {type(spec).__name__}")
        if spec.model_type in self._specs and not replace:
            raise ValueError(f"architecture {spec.model_type!r} is already registered; pass replace=True to "
                             "override the shipped spec")
        for other in self._specs.values():
            if other.model_type != spec.model_type and other.mcore is spec.mcore:
                raise ValueError(
                    f"the spec of {spec.model_type!r} shares its Megatron part with {other.model_type!r} (derived "
                    "with dataclasses.replace without restating mcore=): state it explicitly, e.g. "
                    f"mcore=McoreSpec(rules=...) or McoreSpec(refused='...'), so no rule is inherited silently"
                )
        self._specs[spec.model_type] = spec

    def remove(self, model_type: str, restore: ArchSpec | None = None) -> None:
        """Undo an ``add`` (``restore``: the spec it replaced)."""
        self._specs.pop(model_type, None)
        if restore is not None:
            self._specs[model_type] = restore

    def get(self, model_type: str) -> ArchSpec:
        try:
            return self._specs[model_type]
        except KeyError:
            raise UnsupportedArchitectureError(
                f"architecture {model_type!r} is not registered in actorcore; registered: "
                f"{', '.join(self.model_types())}. Add src/actorcore/archs/{model_type}.py, or call "
                "actorcore.register_arch(spec, config) to support it."
            ) from None

    def find(self, model_type: str) -> ArchSpec | None:
        return self._specs.get(model_type)

    def model_types(self) -> list[str]:
        return sorted(self._specs)


def _shipped_specs() -> dict[str, ArchSpec]:
    specs: dict[str, ArchSpec] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in _NOT_SPECS or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if not isinstance(spec, ArchSpec):
            raise TypeError(f"actorcore/archs/{info.name}.py must define SPEC = ArchSpec(...)")
        if spec.model_type != info.name:
            raise TypeError(f"actorcore/archs/{info.name}.py declares model_type {spec.model_type!r}; "
                            "the file name must be the model_type")
        specs[spec.model_type] = spec
    return specs


@functools.cache
def registry() -> Registry:
    return Registry(_shipped_specs())


def registered_model_types() -> list[str]:
    return registry().model_types()


def get_spec(model_type: str) -> ArchSpec:
    return registry().get(model_type)


def text_config(config: Any) -> Any:
    """The language model's config (the config itself for text models)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_config(spec: ArchSpec, config: Any) -> None:
    """Refuse config fields the spec declares unsupported, and head transforms it does not apply."""
    for field_name, reason in spec.unsupported_config:
        if getattr(config, field_name, None):
            raise UnsupportedArchitectureError(
                f"{spec.model_type}: config.{field_name}={getattr(config, field_name)!r} is not supported: {reason}"
            )
    declared = {t.field for t in spec.head}
    text = text_config(config)
    for field_name, op in HEAD_CONFIG_FIELDS.items():
        value = getattr(text, field_name, None)
        if field_name not in declared and not HeadTransform(op, field_name).is_neutral(value):
            raise UnsupportedArchitectureError(
                f"{spec.model_type}: config.{field_name}={value!r} changes the logits in the model's own forward "
                f"({op}), but actorcore's spec for {spec.model_type} does not apply it, so the fused head would "
                f"silently skip it. Declare head=(HeadTransform({op!r}, {field_name!r}), ...) in the spec, in the "
                "order the model's forward applies its transforms, and check it with actorcore.verify"
            )


def spec_for_model(model: Any) -> ArchSpec:
    """The spec of a model instance (by ``model.config.model_type``), checked against its config.

    Every route reads the model through here first, so a value that is not a model is refused here."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"model must be a Hugging Face transformers model (a PreTrainedModel with a .config), got "
                         f"{type(model).__name__}; load it with e.g. AutoModelForCausalLM.from_pretrained(...)")
    spec = get_spec(getattr(config, "model_type", None) or type(config).__name__)
    check_config(spec, config)
    return spec
