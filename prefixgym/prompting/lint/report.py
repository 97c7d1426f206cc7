"""Print a lint report as text (for people) or JSON (for tools).

The text form shows, for every finding, the text on both sides of the first
divergence with a caret under it; control characters are escaped so the caret
lines up, and ANSI colour is used only when asked (the command asks when stdout
is a TTY). A template's verdict is one headline (`verdict_line`: append_only at the
settings it was probed for) and one line per switch value that would break the prefix
(`switch_line`); `train` and `rollout` print the same lines. Knows nothing of how
findings were made.
"""

from __future__ import annotations

import json
from typing import Protocol

from prefixgym.prompting.findings import RULES, Finding
from prefixgym.prompting.templates.append_only import TemplateReport
from prefixgym.prompting.templates.content import describe
from prefixgym.types import JSONObject

_RED, _GREEN, _YELLOW, _BOLD, _DIM, _RESET = (
    "\033[31m", "\033[32m", "\033[33m", "\033[1m", "\033[2m", "\033[0m"
)


class Report(Protocol):
    target: str
    append_only: bool
    findings: list[Finding]

    def to_json(self) -> JSONObject: ...


def escape(text: str) -> str:
    """One visible character run per input character class: newlines as \\n, tabs as \\t."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _side(label: str, text: str, caret: int, colour: str, use_colour: bool) -> list[str]:
    head, tail = escape(text[:caret]), escape(text[caret:])
    body = f"{head}{_BOLD}{colour}{tail}{_RESET}" if use_colour else head + tail
    pointer = " " * len(head) + "^"
    if use_colour:
        pointer = f"{_YELLOW}{pointer}{_RESET}"
    pad = " " * len(label)
    return [f"    {label}{body}", f"    {pad}{pointer}"]


def format_finding(finding: Finding, use_colour: bool = False) -> list[str]:
    rule = RULES[finding.rule]
    severity: str = finding.severity
    if use_colour:
        severity = f"{_RED if severity == 'error' else _YELLOW}{severity}{_RESET}"
    lines = [f"{finding.rule} {severity} [{rule.name}] {finding.location}", f"  {finding.message}"]
    occurrences = finding.extra.get("occurrences")
    if occurrences:
        lines.append(f"  (seen {occurrences} times; the first is shown)")
    cost = cost_line(finding.extra)
    if cost:
        lines.append(f"  cost: {cost}")
    if finding.first_divergence is not None:
        where = f"  first divergence at index {finding.first_divergence}"
        token_at = finding.extra.get("first_divergence_token")
        if token_at is not None and token_at != finding.first_divergence:
            where += f" (token {token_at})"
        lines.append(where + ":")
    if finding.expected is not None and finding.actual is not None:
        caret = finding.caret or 0
        lines += _side("expected: ", finding.expected, caret, _RED, use_colour)
        lines += _side("actual:   ", finding.actual, caret, _GREEN, use_colour)
    for side in ("expected", "actual"):
        ids = finding.extra.get(f"{side}_ids", finding.extra.get(f"{side}_tokens"))
        pieces = finding.extra.get(f"{side}_tokens") if f"{side}_ids" in finding.extra else None
        if ids:
            shown = ", ".join(f"{i} {escape(repr(p))}" for i, p in zip(ids, pieces)) if pieces else \
                ", ".join(map(str, ids))
            lines.append(f"    {side} ids from there: [{shown}]")
    return lines


def cost_line(extra: JSONObject) -> str:
    """What a finding costs, from the counts its check left in `extra` and the money
    the command priced them at (`reprefill_money`), or "" when it counted nothing."""
    if "reprefilled_tokens" in extra:
        text = f"{extra['reprefilled_tokens']:,} tokens prefilled again over the trace"
    elif "reprefilled_tokens_per_turn" in extra:
        text = (f"{extra['reprefilled_tokens_per_turn']:,} tokens prefilled again per turn "
                f"({extra['reprefilled_chars_per_turn']:,} characters) for the reply shown")
    elif "reprefilled_chars_per_turn" in extra:
        text = (f"{extra['reprefilled_chars_per_turn']:,} characters prefilled again per turn "
                "for the reply shown (with --tokenizer: in tokens, and priced)")
    else:
        return ""
    money = extra.get("reprefill_money")
    return f"{text}; {money}" if money else text


def verdict_line(report: TemplateReport) -> str:
    """'append_only=yes at the template's defaults' or '... at {"enable_thinking": false}'."""
    at = (f"at {json.dumps(report.settings, sort_keys=True)}" if report.settings
          else "at the template's defaults")
    return f"append_only={'yes' if report.append_only else 'no'} {at}"


def switch_line(finding: Finding) -> str:
    """One switch value that breaks the prefix: the switch, the value, the rule, the cost."""
    setting = f"{finding.extra['switch']}={finding.extra['value']!r}"
    line = (f"switch {setting} breaks the prefix: {finding.rule} {finding.severity} "
            f"[{RULES[finding.rule].name}] {finding.message}")
    cost = cost_line(finding.extra)
    return f"{line}; cost: {cost}" if cost else line


def _summary(report: Report) -> str:
    data = report.to_json()
    parts = [f"{report.target}: append_only={'yes' if report.append_only else 'no'}"]
    if data.get("kind") == "trace":
        parts.append(f"{data['requests']} requests, {data['prompt_tokens']} prompt tokens")
        parts.append(f"predicted hit rate {data['predicted_hit_rate']:.1%} "
                     f"(block {data['block_size']}, capacity {data['capacity_tokens']} tokens)")
        if data["observed_hit_rate"] is not None:
            parts.append(f"observed {data['observed_hit_rate']:.1%}")
        observed = data.get("observed_tokens")
        if observed:
            parts.append(f"the sampler counted prefill {observed['prefill_computed_tokens']:,} "
                         f"computed + {observed['prefill_cached_tokens']:,} cached, "
                         f"{observed['sampled_tokens']:,} sampled")
    if isinstance(report, TemplateReport):
        parts = [f"{report.target}: {verdict_line(report)}",
                 f"{len(data['probes_checked'])} probes checked",
                 f"content written as {describe(report.content)}"]
        if data["probes_skipped"]:
            parts.append(f"{len(data['probes_skipped'])} skipped (the template raised under a "
                         "switch setting the probes chose)")
    if data.get("kind") == "env":
        parts.append(f"{data['episodes']} expert episodes, {data['requests']} requests")
        parts.append(f"predicted hit rate {data['predicted_hit_rate']:.1%}")
    return ", ".join(parts)


def render_text(report: Report, use_colour: bool = False) -> str:
    lines = [_summary(report)]
    if isinstance(report, TemplateReport):
        lines += [switch_line(f) for f in report.switches]
    for finding in report.findings:
        lines.append("")
        lines += format_finding(finding, use_colour)
    errors = sum(f.severity == "error" for f in report.findings)
    warnings = len(report.findings) - errors
    lines.append("")
    lines.append(f"{len(report.findings)} finding(s): {errors} error(s), {warnings} warning(s)"
                 if report.findings else "no findings")
    if isinstance(report, TemplateReport) and report.switches:
        lines[-1] += (f"; {len(report.switches)} switch value(s) that break the prefix, "
                      "beside the verdict")
    by_rule = report.to_json().get("reprefilled_tokens_by_rule")
    if by_rule:
        lines.append("tokens prefilled again, by rule: " + ", ".join(
            f"{rule} {tokens:,}" for rule, tokens in sorted(by_rule.items())))
    return "\n".join(lines)


def render_json(report: Report) -> str:
    return json.dumps(report.to_json(), ensure_ascii=False)
