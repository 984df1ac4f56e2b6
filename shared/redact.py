"""Secret values never leave the API or the event views in clear: every ``secret_env`` mapping is masked."""

from __future__ import annotations

from typing import Any

MASK = "<redacted>"
SECRET_KEYS = frozenset({"secret_env"})


def redact(value: Any) -> Any:
    """A copy of a JSON-like value with the values of every ``secret_env`` mapping replaced by MASK."""
    if isinstance(value, dict):
        return {k: ({n: MASK for n in v} if k in SECRET_KEYS and isinstance(v, dict) else redact(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value
