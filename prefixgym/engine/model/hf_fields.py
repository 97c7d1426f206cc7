"""Type-checked fields of one Hugging Face config.json: `ConfigReader` reads a field as
config.json has it, or as an int or a finite number, and its errors name the file and
the field (a list where an int belongs is refused, never coerced).

Knows JSON values and field names; nothing of families, RoPE or tensors.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from prefixgym.types import JSONObject

__all__ = ["ConfigReader"]


class ConfigReader:
    """Type-checked fields of one config.json, errors naming the file and field."""

    def __init__(self, cfg: JSONObject, path: Path) -> None:
        self.cfg, self.path = cfg, path

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def field(self, key: str, default: Any = None) -> Any:
        """The field as config.json has it (null included), `default` when absent."""
        return self.cfg[key] if key in self.cfg else default

    def int(self, key: str, default: int | None = None, source: JSONObject | None = None) -> int:
        value = (source if source is not None else self.cfg).get(key)
        if value is None:
            if default is None:
                raise self.error(f"required field {key!r} is missing")
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(f"field {key!r} must be an integer, got {value!r}")
        return value

    def float(self, key: str, default: float, source: JSONObject | None = None) -> float:
        value = (source if source is not None else self.cfg).get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(
                value):
            raise self.error(f"field {key!r} must be a number, got {value!r}")
        return float(value)
