"""The one place that checks megatron-core is importable (it is an optional dependency)."""

from __future__ import annotations

import functools
from actorcore.errors import MegatronNotInstalledError  # noqa: F401 (re-exported)


@functools.cache
def require_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise MegatronNotInstalledError(
            "the Megatron-Core route needs megatron-core: pip install 'megatron-core>=0.16,<0.17' psutil "
            f"(the version actorcore is tested with); import failed with: {exc}"
        ) from exc
