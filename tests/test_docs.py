"""The file map (docs/files.md) matches the tree, and the docs link only to files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def file_map() -> list[str]:
    """The first word of every line of docs/files.md's file-map code block."""
    text = (ROOT / "docs" / "files.md").read_text()
    block = text.split("## File map", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def test_every_path_in_the_file_map_exists() -> None:
    missing = [p for p in file_map() if not (ROOT / p).exists()]
    assert missing == []


def test_every_package_module_is_in_the_file_map() -> None:
    named = set(file_map())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "prefixgym").rglob("*.py")}
    assert sorted(modules - named) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_point_to_files_in_the_repository(doc: Path) -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text())
    local = [link for link in links if "://" not in link and not link.startswith("mailto:")]
    missing = [link for link in local if not (doc.parent / link).exists()]
    assert missing == []


WRITTEN_BY_A_RUN = {"report.md"}


def test_every_markdown_file_named_in_code_and_docs_exists() -> None:
    sources = [*DOCS, *(ROOT / "prefixgym").rglob("*.py"), *(ROOT / "examples").rglob("*.py"),
               *(ROOT / "bench").glob("*.py")]
    in_repo = {p.relative_to(ROOT).as_posix() for p in ROOT.glob("**/*.md")
               if ".venv" not in p.parts}
    names = {Path(p).name for p in in_repo}  # a bare name may stand for its file anywhere
    missing = []
    for source in sources:
        for named in set(re.findall(r"[\w./-]*\w\.md\b", source.read_text())):
            if Path(named).name in WRITTEN_BY_A_RUN:
                continue
            if named not in in_repo and ("/" in named or named not in names):
                missing.append(f"{source.relative_to(ROOT)}: {named}")
    assert missing == []
