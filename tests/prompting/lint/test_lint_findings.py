"""docs/lint-rules.md explains every rule, under its code, name and severity, and no other."""

from __future__ import annotations

import re
from pathlib import Path

from prefixgym.prompting.findings import RULES

DOC = Path(__file__).resolve().parents[3] / "docs" / "lint-rules.md"


def test_every_rule_has_its_section_in_the_docs() -> None:
    headings = re.findall(r"^### (PG\d{3}) ([\w-]+) \((error|warning)\)$", DOC.read_text(), re.M)
    assert headings == [(r.code, r.name, r.severity) for r in RULES.values()]
