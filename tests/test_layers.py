"""The package's imports follow the layer table in docs/architecture.md, without cycles
between parts (the engine's wings included) or between any two files."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "prefixgym"
TABLE = ROOT / "docs" / "architecture.md"


def allowed_arrows() -> dict[str, set[str]]:
    """part -> what it may import, read from the table between the `layers` markers."""
    text = TABLE.read_text()
    table = text.split("<!-- layers")[1].split("<!-- /layers -->")[0]
    arrows: dict[str, set[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        arrows[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[2]))
    return arrows


WINGED = {"engine"}
"""Subpackages whose own modules and subpackages are parts of the table (the wings)."""


def part_of(module: str) -> str:
    """`prefixgym.engine.sampler.scheduler` -> `engine.sampler`; `prefixgym.engine` ->
    `engine`; `prefixgym.trainer.grpo` -> `trainer`; `prefixgym.types` -> `types`;
    `prefixgym`."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in WINGED:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "prefixgym"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Every prefixgym module `path` imports, at any depth (functions, TYPE_CHECKING)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from prefixgym.x import y` may import the module prefixgym.x.y
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return [(m, line) for m, line in found if m == "prefixgym" or m.startswith("prefixgym.")]


def allows(rules: set[str], target: str) -> bool:
    rest = target.split(".", 1)[1] if "." in target else "prefixgym"
    return any(rest == r or rest.startswith(r + ".") for r in rules)


def edges() -> dict[tuple[str, str], list[str]]:
    """(from part, to part) -> where, for every import between two different parts."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(module_name(path))
        for target, line in imports_of(path):
            # a name imported from a package may be an attribute, not a submodule
            target = _existing_module(target)
            dest = part_of(target)
            if dest != source:
                found[(source, dest)].append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return found


def _existing_module(target: str) -> str:
    parts = target.split(".")
    while len(parts) > 1:
        candidate = ROOT.joinpath(*parts)
        if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
            return ".".join(parts)
        parts.pop()
    return "prefixgym"


def test_the_table_names_every_part_of_the_package() -> None:
    arrows = allowed_arrows()
    parts = {part_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert parts - set(arrows) == set(), "parts missing from docs/architecture.md"
    assert set(arrows) - parts == set(), "the table names parts that do not exist"
    for part, rules in arrows.items():
        for rule in rules:
            assert part_of(f"prefixgym.{rule}") in arrows or rule.split(".")[0] in arrows, (
                f"{part} may import unknown {rule!r}")


def test_every_import_follows_the_table() -> None:
    arrows = allowed_arrows()
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(module_name(path))
        for target, line in imports_of(path):
            target = _existing_module(target)
            if part_of(target) == source or allows(arrows[source], target):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {source} may not import {target}")
    assert bad == []


def test_no_cycle_between_parts() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for source, dest in edges():
        graph[source].add(dest)

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                return [*path[path.index(nxt):], nxt]
            found = cycle_from(nxt, [*path, nxt])
            if found:
                return found
        return None

    for start in sorted(graph):
        cycle = cycle_from(start, [start])
        assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize("source", ["engine.service", "prompting", "envs", "rollouts", "trainer"])
def test_no_layer_imports_an_entry_point(source: str) -> None:
    assert "cli" not in allowed_arrows()[source]
    assert not [e for e in edges() if e == (source, "cli")]


def test_the_sampler_and_trainer_wings_never_import_each_other() -> None:
    """Only the service sees both: a new weights version reaches samplers through the
    `publish` callable it hands the trainer."""
    arrows = allowed_arrows()
    for a, b in (("engine.sampler", "engine.trainer"), ("engine.trainer", "engine.sampler")):
        assert not allows(arrows[a], f"prefixgym.{b}")
        assert (a, b) not in edges()
    for wing in ("engine.model", "engine.sampler", "engine.trainer"):
        assert not allows(arrows[wing], "prefixgym.engine.service")


def test_no_cycle_between_files() -> None:
    """No two modules import each other, directly or around a loop (function-level and
    TYPE_CHECKING imports included)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        for target, _ in imports_of(path):
            target = _existing_module(target)
            if target != source and not source.startswith(target + "."):  # not its package
                graph[source].add(target)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        assert cycle is None, " -> ".join(cycle or [])


def test_the_chat_format_does_not_import_the_linter() -> None:
    """The runtime chat format needs the append-only verdict (`prompting.templates`), not
    the linter's reports: nothing in prompting outside `prompting.lint` imports it."""
    bad = []
    for path in sorted((PACKAGE / "prompting").rglob("*.py")):
        if "lint" in path.relative_to(PACKAGE / "prompting").parts:
            continue
        for target, line in imports_of(path):
            if target.startswith("prefixgym.prompting.lint"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert bad == []
