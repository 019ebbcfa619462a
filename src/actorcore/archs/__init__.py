"""Registry of architecture specs, discovered from the modules of this package (one per ``model_type``).

Adding an architecture = one ``archs/<model_type>.py`` defining ``SPEC`` + one tiny config in
``actorcore.testing.tiny_configs``. Nothing here is hand-synced.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Any

from actorcore.archs.spec import ArchSpec, UnsupportedArchitectureError

__all__ = ["ArchSpec", "UnsupportedArchitectureError", "get_spec", "registered_model_types", "spec_for_model"]

_NOT_SPECS = {"spec", "megatron_rules"}


@functools.cache
def _registry() -> dict[str, ArchSpec]:
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


def registered_model_types() -> list[str]:
    return sorted(_registry())


def get_spec(model_type: str) -> ArchSpec:
    try:
        return _registry()[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not registered in actorcore; registered: "
            f"{', '.join(registered_model_types())}. Add src/actorcore/archs/{model_type}.py to support it."
        ) from None


def spec_for_model(model: Any) -> ArchSpec:
    """The spec of a model instance (by ``model.config.model_type``), checked against refused config fields."""
    config = model.config
    spec = get_spec(getattr(config, "model_type", None) or type(config).__name__)
    for field_name, reason in spec.unsupported_config:
        if getattr(config, field_name, None):
            raise UnsupportedArchitectureError(
                f"{spec.model_type}: config.{field_name}={getattr(config, field_name)!r} is not supported: {reason}"
            )
    return spec
