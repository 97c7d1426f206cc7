"""The linter's vocabulary: rule codes, severities and the `Finding` record.

PG1xx rules are about chat templates, PG2xx about rollout traces, PG3xx about
environments. What each rule means and how to fix it is docs/lint-rules.md, one
section per rule (a test keeps the two lists equal). This module only names and
filters findings; it does not know how they are detected or printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from prefixgym.types import JSONObject

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    severity: Severity


RULES: dict[str, Rule] = {
    r.code: r
    for r in [
        Rule("PG101", "reasoning-stripped", "error"),
        Rule("PG102", "system-moved", "error"),
        Rule("PG103", "end-of-turn-changed", "error"),
        Rule("PG104", "eos-in-history", "error"),
        Rule("PG105", "whitespace-changed", "error"),
        Rule("PG106", "system-role-refused", "error"),
        Rule("PG107", "history-rewritten", "error"),
        Rule("PG108", "reads-current-date", "warning"),
        Rule("PG109", "probe-failed", "warning"),
        Rule("PG110", "token-boundary-merge", "warning"),
        Rule("PG111", "reasoning-opener-dropped", "error"),
        Rule("PG112", "reply-whitespace-changed", "error"),
        Rule("PG113", "render-limit", "error"),
        Rule("PG201", "retokenized-history", "error"),
        Rule("PG202", "fixed-prefix-changed", "error"),
        Rule("PG203", "volatile-prefix", "error"),
        Rule("PG204", "history-edited", "error"),
        Rule("PG205", "prompt-logprobs-bypass", "warning"),
        Rule("PG206", "group-split", "warning"),
        Rule("PG301", "env-prefix-varies", "error"),
        Rule("PG302", "env-not-append-only", "error"),
    ]
}


@dataclass
class Finding:
    """One problem found, located precisely enough to fix it.

    `first_divergence` is a character index into the rendered text (templates) or a
    token index into the prompt (traces); `expected`/`actual` hold the text on both
    sides of it (short windows); `caret` is where in those windows they part.
    """

    rule: str
    message: str
    location: str
    first_divergence: int | None = None
    expected: str | None = None
    actual: str | None = None
    caret: int | None = None
    extra: JSONObject = field(default_factory=dict)

    @property
    def severity(self) -> Severity:
        """The rule's, unless the finding was graded down (`extra["severity"]`: a break
        that needs a condition the caller controls, e.g. PG112's edge whitespace)."""
        graded = self.extra.get("severity")
        return "warning" if graded == "warning" else RULES[self.rule].severity

    def to_json(self) -> JSONObject:
        out: JSONObject = {
            "rule": self.rule,
            "name": RULES[self.rule].name,
            "severity": self.severity,
            "message": self.message,
            "location": self.location,
            "first_divergence": self.first_divergence,
        }
        if self.expected is not None or self.actual is not None:
            out["expected"] = self.expected
            out["actual"] = self.actual
            out["caret"] = self.caret
        out.update(self.extra)
        return out


def parse_codes(value: str | list[str] | None) -> list[str]:
    """'PG1, PG203' or ['PG1', 'PG203'] -> ['PG1', 'PG203'] (validated prefixes)."""
    if value is None:
        return []
    parts = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    codes = [p.strip().upper() for p in parts if p.strip()]
    for code in codes:
        if code != "ALL" and not any(rule.startswith(code) for rule in RULES):
            raise ValueError(f"unknown rule code or prefix {code!r} (known: PG1xx, PG2xx, PG3xx)")
    return codes


def is_selected(rule: str, select: list[str], ignore: list[str]) -> bool:
    """A rule is kept when it matches a select prefix (or select is empty) and no ignore prefix."""
    chosen = not select or any(s == "ALL" or rule.startswith(s) for s in select)
    return chosen and not any(i == "ALL" or rule.startswith(i) for i in ignore)


def filter_findings(findings: list[Finding], select: list[str], ignore: list[str]) -> list[Finding]:
    return [f for f in findings if is_selected(f.rule, select, ignore)]


class LintInputError(ValueError):
    """Input the linter cannot read: a missing file, a bad JSON line, a broken template.

    The command prints its message as one line and exits 2.
    """
