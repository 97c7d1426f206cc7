"""Lint defaults from `[tool.prefixgym.lint]` in the nearest pyproject.toml.

    [tool.prefixgym.lint]
    select = ["PG1", "PG2"]      # or "PG1,PG2"
    ignore = ["PG108"]
    block-size = 16
    capacity-tokens = 1048576

Command-line options win over these. Knows nothing of rules beyond their codes.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from prefixgym.prompting.findings import LintInputError, parse_codes
from prefixgym.prompting.lint.cache_sim import DEFAULT_BLOCK_SIZE, DEFAULT_CAPACITY_TOKENS


@dataclass
class LintConfig:
    select: list[str] = field(default_factory=list)
    """Rule codes or prefixes to report (empty: all)."""
    ignore: list[str] = field(default_factory=list)
    """Rule codes or prefixes never to report."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per block of the simulated prefix cache."""
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    """Tokens the simulated prefix cache holds before it evicts."""
    source: str | None = None
    """The pyproject.toml these values came from, if any."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise LintInputError(f"block-size must be a positive integer, got {self.block_size}")
        if self.capacity_tokens < self.block_size:
            raise LintInputError(
                f"capacity-tokens ({self.capacity_tokens}) must hold at least one block ({self.block_size})"
            )


def find_pyproject(start: Path) -> Path | None:
    for folder in [start, *start.parents]:
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def _int(table: dict[str, object], key: str, default: int, origin: Path) -> int:
    value = table.get(key, table.get(key.replace("-", "_"), default))
    if not isinstance(value, int) or isinstance(value, bool):
        raise LintInputError(f"{origin}: [tool.prefixgym.lint] {key} must be an integer, got {value!r}")
    return value


def load_config(start: Path | None = None) -> LintConfig:
    """The `[tool.prefixgym.lint]` table of the nearest pyproject.toml at or above `start`."""
    path = find_pyproject((start or Path.cwd()).resolve())
    if path is None:
        return LintConfig()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LintInputError(f"{path}: cannot read: {exc}") from None
    table = data.get("tool", {}).get("prefixgym", {}).get("lint", {})
    if not isinstance(table, dict):
        raise LintInputError(f"{path}: [tool.prefixgym.lint] must be a table")
    try:
        select, ignore = parse_codes(table.get("select")), parse_codes(table.get("ignore"))
    except ValueError as exc:
        raise LintInputError(f"{path}: [tool.prefixgym.lint]: {exc}") from None
    return LintConfig(
        select=select,
        ignore=ignore,
        block_size=_int(table, "block-size", DEFAULT_BLOCK_SIZE, path),
        capacity_tokens=_int(table, "capacity-tokens", DEFAULT_CAPACITY_TOKENS, path),
        source=str(path),
    )
