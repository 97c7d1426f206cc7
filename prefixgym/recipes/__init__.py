"""Shipped training recipes: TOML files of `prefixgym train` settings, used by name.

`prefixgym train --config tools` reads `tools.toml` from this folder when no file
named `tools` exists where the command runs; flags given with it still win. Each
recipe's header says what it trains, what it reaches and the command that measured
it (docs/benchmarks.md has the tables). Knows file names only.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["config_path", "recipe_names"]

_HERE = Path(__file__).parent


def recipe_names() -> list[str]:
    """The shipped recipes, by name."""
    return sorted(p.stem for p in _HERE.glob("*.toml"))


def config_path(given: str) -> str:
    """`given` itself when it names an existing file, else the shipped recipe of that
    name; ValueError (naming the recipes) for neither."""
    if Path(given).exists():
        return given
    if given in recipe_names():
        return str(_HERE / f"{given}.toml")
    raise ValueError(f"no config file {given!r} (and no shipped recipe of that name; "
                     f"recipes: {', '.join(recipe_names()) or 'none'})")
