"""Options given as one JSON object on the command line (`--speculative-config`, `--pooler-config`,
`--hf-overrides`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def json_object(value: str | Mapping[str, Any], what: str, example: str,
                known: set[str] | None = None) -> Mapping[str, Any]:
    """`value` (JSON text or a mapping) as a mapping of `known` keys (None: any); anything else is refused,
    naming `what`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{what} is not JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON object, e.g. {example}")
    unknown = sorted(set(value) - known) if known is not None else []
    if unknown:
        raise ValueError(f"{what} has unknown keys {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return value
