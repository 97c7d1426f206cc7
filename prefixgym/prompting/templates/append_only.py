"""Probe a chat template: does every rendered prompt extend the previous prompt + the sampled reply?

`probe_template` is the one writer of that verdict, for `prefixgym lint template`, for
`HFTemplateFormat` (which refuses a template that breaks at the run's settings) and so
for the first lines of `train` and `rollout`. The verdict is for the run's settings:
the template's defaults, or the switches the run passes (`template_kwargs`). Each other
value of a switch that breaks the prefix where the run's settings do not is reported
beside it (`switches`), one finding per switch value and rule, and leaves the verdict
alone: Granite 3.1 is append-only unless `controls=True` is passed.

1) Read what the template knows (`switches.py`): its reasoning markers and the
   switches it reads, each tried both ways (the run's settings first), and the shape
   of message content it prints (`content.py`: strings, or lists of text parts).
2) Run every probe (`probes.py`) through the `Prober` (`prober.py`), which renders
   it at a fixed clock, in that content shape, and records each break as a sighting.
3) A probe the template raises on is PG106 (only the system message is refused) or
   PG109 under the defaults, and merely skipped under a switch setting. A render
   that exceeds its time, memory or output limit is PG113, whatever the setting, and
   ends the probing (every further render would wait out the limit too).
4) Render at two clocks: a template that prints the date is PG108.
5) One finding per rule, at its first sighting under the run's settings; when every
   sighting shares a condition that not every probe had, the finding says so ("breaks
   only when the reply contains a <think> block"). Then one finding per switch value
   and rule that the run's settings did not break, costed by its first sighting of
   (c) (a whole turn prefilled again), in `switches`.
6) A PG112 break seen only for replies with whitespace at their edges (the template
   trims them, as Llama 3's, Gemma's and SmolLM3's do) is graded a warning that names
   the condition: replies written as the template expects extend the prompt.
The verdict is append-only only when no rule broke under the run's settings (a graded
PG112 aside, unless `strict`), no render hit a limit, and at least one probe was
checked under them (a template that raises on every probe has shown nothing).
Knows nothing of files or output formats.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixgym.prompting.divergence import context_window, first_divergence
from prefixgym.prompting.findings import Finding
from prefixgym.prompting.templates.content import STRINGS, ContentShape, read_shapes, shaped
from prefixgym.prompting.templates.prober import Prober, Sighting
from prefixgym.prompting.templates.probes import Probe, Style, probe_conversations
from prefixgym.prompting.templates.render import (
    CLOCK_A,
    CLOCK_B,
    RenderError,
    RenderLimits,
    TemplateRenderer,
)
from prefixgym.prompting.templates.switches import (
    DEFAULT,
    Marker,
    Setting,
    reasoning_markers,
    switch_settings,
)
from prefixgym.types import JSONObject

if TYPE_CHECKING:  # a tokenizer is optional here; transformers loads only with one
    from transformers import PreTrainedTokenizerBase

BREAK_RULES = {"PG101", "PG102", "PG103", "PG104", "PG105", "PG107", "PG111", "PG112"}
EDGE_WHITESPACE = frozenset({"the reply has spaces around it", "the reply has newlines around it"})
"""The reply conditions a template does not control: whitespace a model put at its edges."""
_DIMENSIONS = ("setting", "system", "tools", "reply", "end")
_REASONING_CLAUSE = "the reply contains a "


@dataclass
class TemplateReport:
    target: str
    append_only: bool
    findings: list[Finding]
    reads_date: bool = False
    probes_checked: list[str] = field(default_factory=list)
    probes_skipped: dict[str, str] = field(default_factory=dict)
    """Probes under a switch setting that the template raised on: name -> error."""
    breaks_by_default: list[str] = field(default_factory=list)
    """The break rules seen with the template's switches at their defaults."""
    closing: str | None = None
    """What the template renders after a reply (its end of turn), under its defaults."""
    separator: str = ""
    """The whitespace the template puts between the generation prompt and a reply."""
    num_checked_by_default: int = 0
    """How many probes were checked with the template's switches at their defaults."""
    settings: JSONObject = field(default_factory=dict)
    """The switches the verdict is for (a run's template kwargs); {}: the defaults. The
    "default" in the names above means these settings."""
    switches: list[Finding] = field(default_factory=list)
    """Breaks that a switch set to another value adds, one per switch value and rule;
    `extra["switch"]` and `extra["value"]` name the setting. Not in the verdict."""
    content: dict[str, ContentShape] = field(default_factory=lambda: dict(STRINGS))
    """The content shape the probes wrote each role's messages in."""

    def to_json(self) -> JSONObject:
        return {
            "target": self.target,
            "kind": "template",
            "append_only": self.append_only,
            "settings": self.settings,
            "content_shape": dict(self.content),
            "reads_date": self.reads_date,
            "probes_checked": self.probes_checked,
            "probes_skipped": self.probes_skipped,
            "breaks_by_default": self.breaks_by_default,
            "findings": [f.to_json() for f in self.findings],
            "switches": [f.to_json() for f in self.switches],
        }

    def first_default_break(self) -> Finding | None:
        """The first finding that breaks the template under its defaults, if any."""
        return next((f for f in self.findings if f.rule in self.breaks_by_default), None)


def only_when(sightings: list[Sighting], seen: Mapping[Setting, Mapping[str, set[str]]]) -> list[str]:
    """The conditions every sighting shares that not every check had, one per dimension.

    A switch setting is compared with all settings; the other dimensions with the
    checks made under the settings the sightings were made in (under a setting that
    opens a reasoning block, plain replies do not apply)."""
    settings = {s.setting for s in sightings}
    clauses, either = [], []
    for dimension in _DIMENSIONS:
        values = {s.conditions.get(dimension) for s in sightings}
        checked = {clause for setting, dimensions in seen.items()
                   if dimension == "setting" or setting in settings
                   for clause in dimensions.get(dimension, set())}
        if None in values or len(checked) < 2:
            continue
        if len(values) == 1:
            clauses.append(str(values.pop()))
        elif dimension == "reply" and all(str(v).startswith(_REASONING_CLAUSE) for v in values):
            if not all(c.startswith(_REASONING_CLAUSE) for c in checked):
                clauses.append("the reply contains a reasoning block")
        elif len(values) == 2 and len(checked) > 2:
            either.append("(" + " or ".join(sorted(str(v) for v in values)) + ")")
    return clauses + either


def _findings(sightings: list[Sighting], seen: Mapping[Setting, Mapping[str, set[str]]]) -> list[Finding]:
    by_rule: dict[str, list[Sighting]] = {}
    for sighting in sightings:
        by_rule.setdefault(sighting.rule, []).append(sighting)
    findings = []
    for rule, group in sorted(by_rule.items()):
        first = group[0]
        message = f"{first.reason}: {first.what}" if first.what else first.reason
        clauses = only_when(group, seen)
        if clauses:
            message += "; breaks only when " + " and ".join(clauses)
        extra = dict(first.extra)
        if len(group) > 1:
            extra["occurrences"] = len(group)
        if clauses:
            extra["only_when"] = clauses
        findings.append(Finding(rule, message, first.location, first.first_divergence,
                                first.expected, first.actual, first.caret, extra))
    return findings


def _switch_findings(sightings: list[Sighting], seen: Mapping[Setting, Mapping[str, set[str]]],
                     by_default: list[str], strict: bool) -> list[Finding]:
    """Step 5's second half: per switch setting, its break rules that the run's settings
    do not break, one finding each, named and costed."""
    groups: dict[Setting, list[Sighting]] = {}
    for sighting in sightings:
        if (sighting.setting != DEFAULT and sighting.rule in BREAK_RULES
                and sighting.rule not in by_default):
            groups.setdefault(sighting.setting, []).append(sighting)
    found: list[Finding] = []
    for setting, group in groups.items():
        findings = _findings(group, {setting: seen[setting]})
        if not strict:
            _grade_edge_whitespace(findings, group)
        [(name, value)] = setting.variables
        for finding in findings:
            # what a turn costs: the first (c) sighting, where the whole next prompt is compared
            turn = next((s for s in group if s.rule == finding.rule and s.check == "next"), None)
            if turn is not None:
                for key in ("reprefilled_chars_per_turn", "reprefilled_tokens_per_turn"):
                    if key in turn.extra:
                        finding.extra[key] = turn.extra[key]
            finding.extra["switch"] = name
            finding.extra["value"] = value
        found += findings
    return found


def _date_finding(renderer: TemplateRenderer, origin: str,
                  content: Mapping[str, ContentShape] = STRINGS) -> Finding | None:
    """PG108: two clocks render two texts, or the source reads a date."""
    probe = Probe(Style("plain"), has_system=True, with_tools=False)
    messages = shaped(probe.prefix_messages() + probe.observations(0), content)
    try:
        a = renderer.render(messages, True, None, clock=CLOCK_A)
        b = renderer.render(messages, True, None, clock=CLOCK_B)
    except RenderError:
        a = b = ""
    if a != b:
        at = first_divergence(a, b)
        at = len(a) if at is None else at
        expected, caret = context_window(a, at)
        actual, _ = context_window(b, at)
        return Finding("PG108", "the rendered prompt changes with the clock (two fixed clocks render "
                       "different text): every day starts a new cache prefix",
                       f"{origin}: probe '{probe.name}'", at, expected, actual, caret)
    if renderer.reads_date_statically:
        return Finding("PG108", "the template reads a date (strftime_now / date variable); callers "
                       "that pass today's date change the prefix every day", origin)
    return None


def probe_template(template_str: str, bos_token: str | None = None, eos_token: str | None = None,
                   tokenizer: PreTrainedTokenizerBase | None = None, origin: str = "<template>",
                   variables: Mapping[str, Any] | None = None,
                   limits: RenderLimits | None = None, strict: bool = False,
                   template_kwargs: Mapping[str, Any] | None = None) -> TemplateReport:
    """Render `template_str` over the probe conversations and report every break.

    `variables` go to every render (a tokenizer's other special tokens), and so do
    `template_kwargs`, the switches the run passes, which the verdict is for; `limits`
    bound each render; `strict` keeps every PG112 an error (step 6 off). Raises
    `LintInputError` when the template does not compile.
    """
    settings = dict(template_kwargs or {})
    renderer = TemplateRenderer(template_str, bos_token, eos_token, origin,
                                {**(variables or {}), **settings}, limits)
    # 1) what the template knows
    markers = reasoning_markers(template_str)
    content = read_shapes(lambda messages: renderer.render(messages, False))
    prober = Prober(renderer, origin, markers, tokenizer, content)
    switches = [s for s in switch_settings(renderer.syntax_tree) if not _is_set(s, settings)]
    # 2) every probe
    run = _run_probes(prober, renderer, markers, switches)
    # 3) probes the template raised on, or that hit a render limit
    by_default = sorted({s.rule for s in prober.sightings
                         if s.setting == DEFAULT and s.rule in BREAK_RULES})
    at_settings = [s for s in prober.sightings if s.setting == DEFAULT]
    findings = _findings(at_settings, {DEFAULT: prober.seen[DEFAULT]})
    findings += _failure_findings(run, renderer, origin)
    findings = _first_per_rule(findings)
    # 4) the date
    date = _date_finding(renderer, origin, content)
    if date is not None:
        findings.append(date)
    findings.sort(key=lambda f: f.rule)
    if not strict:  # 6)
        _grade_edge_whitespace(findings, at_settings)
    shape = prober.shapes.get(DEFAULT)
    return TemplateReport(
        target=origin,
        append_only=(not any(f.rule in BREAK_RULES | {"PG113"} and f.severity == "error"
                             for f in findings) and run.num_checked_by_default > 0),
        findings=findings,
        reads_date=date is not None,
        probes_checked=run.checked,
        probes_skipped=run.skipped,
        breaks_by_default=by_default,
        closing=shape.closing if shape else None,
        separator=shape.separator if shape else "",
        num_checked_by_default=run.num_checked_by_default,
        settings=settings,
        switches=_switch_findings(prober.sightings, prober.seen, by_default, strict),
        content=content,
    )


@dataclass
class _ProbeRun:
    """What step 2 saw: probes checked, failed (under the run's settings) or skipped (under
    a switch setting), and those a render limit cut off."""

    checked: list[str] = field(default_factory=list)
    num_checked_by_default: int = 0
    failures: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    limited: list[str] = field(default_factory=list)
    """The probe that hit a render limit, then those never tried."""


def _run_probes(prober: Prober, renderer: TemplateRenderer, markers: list[Marker],
                switches: list[Setting]) -> _ProbeRun:
    """Step 2: every probe through the prober, until a render hits a limit."""
    run = _ProbeRun()
    for probe in probe_conversations(markers, switches):
        if renderer.limit_hit is not None:
            run.limited.append(probe.name)
            continue
        outcome = prober.run(probe)
        if outcome == "checked":
            run.checked.append(probe.name)
            run.num_checked_by_default += probe.setting == DEFAULT
        elif outcome == "failed" and renderer.limit_hit is not None:
            run.limited.append(probe.name)
        elif outcome == "failed":
            (run.failures if probe.setting == DEFAULT else run.skipped)[probe.name] = prober.failed
    return run


def _failure_findings(run: _ProbeRun, renderer: TemplateRenderer, origin: str) -> list[Finding]:
    """Step 3: PG113 for a render limit, PG106 for a refused system message, PG109 for any
    other probe the template raised on under the run's settings."""
    findings: list[Finding] = []
    if run.limited:
        findings.append(Finding(
            "PG113", f"rendering exceeded a limit ({renderer.limit_hit}): the template loops or "
            f"grows its text without bound; {len(run.limited)} probe(s) were not checked",
            f"{origin}: probe '{run.limited[0]}'", extra={"probes_not_checked": run.limited}))
    for name, error in run.failures.items():
        plain_name = name.removeprefix("system+")
        if name.startswith("system+") and plain_name in run.checked:
            findings.append(Finding("PG106", f"the template raises on a system message ({error}); "
                                    "callers then fold the system prompt into a user turn, often the "
                                    "last one", f"{origin}: probe '{name}'"))
        else:
            findings.append(Finding("PG109", f"the template raised, so this probe was not checked: "
                                    f"{error}", f"{origin}: probe '{name}'"))
    return findings


def _is_set(setting: Setting, settings: Mapping[str, Any]) -> bool:
    """Whether the run's settings already pass this switch value (a probe of it would
    repeat the run's own)."""
    return all(name in settings and settings[name] == value
               and type(settings[name]) is type(value) for name, value in setting.variables)


def _grade_edge_whitespace(findings: list[Finding], sightings: list[Sighting]) -> None:
    """Step 6: a PG112 every sighting of which had whitespace at the reply's edges."""
    pg112 = [s for s in sightings if s.rule == "PG112"]
    finding = next((f for f in findings if f.rule == "PG112"), None)
    if finding is None or not all(s.conditions.get("reply") in EDGE_WHITESPACE for s in pg112):
        return
    finding.extra["severity"] = "warning"
    finding.extra["condition"] = "the reply has whitespace at its edges"
    finding.message += ("; graded a warning: a reply without whitespace at its edges, as the "
                        "template writes replies, extends the prompt (`--strict`: an error)")


def _first_per_rule(findings: list[Finding]) -> list[Finding]:
    """One finding per rule: the first, counting the others as occurrences."""
    kept: dict[str, Finding] = {}
    for finding in findings:
        first = kept.setdefault(finding.rule, finding)
        if first is not finding:
            first.extra["occurrences"] = first.extra.get("occurrences", 1) + 1
    return list(kept.values())
