"""Probe a chat template: does every rendered prompt extend the previous prompt + reply?

For each probe conversation (see `probes.py`), rendered at a fixed clock:
  1) (a) each rendered history extends the previous one (one message more);
  2) (b) the generation prompt P_k is a prefix of the history H_k that ends with
     the reply;
  3) (c) P_k + the sampled text S_k (what the template puts after P_k in H_k: an
     optional separator such as the SentencePiece space, the reply, and the end of
     turn up to EOS) is a prefix of the next generation prompt P_{k+1}.
Each break is classified at its first diverging character; with a tokenizer the
renders are also compared token by token. A template that prints the date is
found by rendering at two clocks. Knows nothing of files or output formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

from prefixgym.prompting.lint.divergence import (
    context_window,
    first_divergence,
    is_whitespace_change,
)
from prefixgym.prompting.lint.findings import Finding
from prefixgym.prompting.lint.probes import SYSTEM_TEXT, Probe, Reply, probe_conversations
from prefixgym.prompting.lint.render import CLOCK_A, CLOCK_B, RenderError, TemplateRenderer
from prefixgym.types import JSONObject

if TYPE_CHECKING:  # a tokenizer is optional here; transformers loads only with one
    from transformers import PreTrainedTokenizerBase

REASONING_OPENERS = ("<think>", "<thinking>", "<reasoning>")
BREAK_RULES = {"PG101", "PG102", "PG103", "PG104", "PG105", "PG107"}


@dataclass
class TemplateReport:
    target: str
    append_only: bool
    findings: list[Finding]
    reads_date: bool = False
    probes_checked: list[str] = field(default_factory=list)

    def to_json(self) -> JSONObject:
        return {
            "target": self.target,
            "kind": "template",
            "append_only": self.append_only,
            "reads_date": self.reads_date,
            "probes_checked": self.probes_checked,
            "findings": [f.to_json() for f in self.findings],
        }


@dataclass
class _Turn:
    """One step of a rendered probe."""

    prompt: str  # P_k
    history: str  # H_k
    sampled: str | None  # S_k, None when it cannot be told
    eot_len: int | None  # length of the end of turn that closes S_k

    @property
    def eot_start(self) -> int | None:
        """Where the end of turn starts, as an index into prompt + sampled."""
        if self.sampled is None or self.eot_len is None:
            return None
        return len(self.prompt) + len(self.sampled) - self.eot_len


def _fill_end_of_turn(turns: list[_Turn]) -> None:
    """Tool-call replies end like the probe's text replies do, when their text says so."""
    known = [t.sampled[len(t.sampled) - t.eot_len:] for t in turns
             if t.sampled is not None and t.eot_len]
    for turn in turns:
        if turn.sampled is not None and turn.eot_len is None:
            turn.eot_len = next((len(e) for e in known if turn.sampled.endswith(e)), None)


def _sampled_text(prompt: str, history: str, reply: Reply, eos: str) -> tuple[str | None, int | None]:
    """S_k and the length of its end of turn (None when the reply's end cannot be located)."""
    if not history.startswith(prompt):
        if reply.content is None:
            return None, None
        return reply.content + eos, len(eos)
    rest = history[len(prompt):]
    at = rest.find(reply.content) if reply.content else -1
    if at >= 0 and reply.content is not None:
        head = rest[: at + len(reply.content)]
        tail = rest[len(head):]
        eot = tail[: tail.find(eos) + len(eos)] if eos and eos in tail else tail.rstrip()
        return head + eot, len(eot)
    if eos and eos in rest:
        return rest[: rest.find(eos) + len(eos)], None
    return rest.rstrip(), None


def _tag_start(text: str, at: int) -> int:
    """`at`, moved back to the '<' when it falls inside a tag such as '<think>' or '<|end|>'."""
    opener = text.rfind("<", max(0, at - 12), at + 1)
    if opener >= 0 and ">" not in text[opener:at]:
        return opener
    return at


def _eos_spanning(left: str, right: str, at: int, eos: str) -> int | None:
    """Start of an EOS in `left` that covers `at` and is not in `right` there."""
    if not eos:
        return None
    for start in range(max(0, at - len(eos) + 1), at + 1):
        if left.startswith(eos, start) and not right.startswith(eos, start):
            return start
    return None


def _classify(left: str, right: str, at: int, probe: Probe, eos: str,
              eot_start: int | None) -> tuple[str, str]:
    """(rule, reason) for a break at `at` between the expected `left` and actual `right`."""
    at = _tag_start(left, at)
    for step in probe.steps:
        reasoning = step.reply.reasoning
        if reasoning and reasoning in left[at:] and reasoning not in right:
            return "PG101", "the reasoning block of an earlier turn is stripped from the history"
    for marker in REASONING_OPENERS:
        if left[at:].lstrip().startswith(marker) and not right[at:].lstrip().startswith(marker):
            return "PG101", f"a {marker} block of an earlier turn is stripped from the history"
    if probe.has_system:
        was, now = left.find(SYSTEM_TEXT), right.find(SYSTEM_TEXT)
        if was >= 0 and now != was:
            where = "is dropped" if now < 0 else "moves to a later position"
            return "PG102", f"the system prompt {where} once the conversation grows"
    eos_at = _eos_spanning(left, right, at, eos)
    if eot_start is not None and at >= eot_start:
        if eos_at is not None and eos_at > eot_start:
            return "PG104", f"EOS {eos!r} is appended after the end of turn but not kept in history"
        if is_whitespace_change(left, right, at):
            return "PG105", "whitespace around the end of turn changes once the turn is in history"
        return "PG103", "the end of turn is rendered differently once the turn is in history"
    if eos_at is not None:
        return "PG104", f"EOS {eos!r} is appended to the rendered history but not kept later"
    if is_whitespace_change(left, right, at):
        return "PG105", "whitespace changes between renders"
    return "PG107", "an earlier part of the conversation renders differently"


def _token_divergence(tokenizer: PreTrainedTokenizerBase, left_ids: list[int], right_ids: list[int]) -> JSONObject:
    at = first_divergence(left_ids, right_ids)
    if at is None:
        return {}
    left, right = left_ids[at : at + 4], right_ids[at : at + 4]
    return {"first_divergence_token": at, "expected_ids": left, "actual_ids": right,
            "expected_tokens": tokenizer.convert_ids_to_tokens(left),
            "actual_tokens": tokenizer.convert_ids_to_tokens(right)}


class _Prober:
    def __init__(self, renderer: TemplateRenderer, origin: str, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.r = renderer
        self.origin = origin
        self.tokenizer = tokenizer
        self.findings: dict[str, Finding] = {}
        self.failed = ""

    def add(self, finding: Finding) -> None:
        first = self.findings.setdefault(finding.rule, finding)
        if first is not finding:
            first.extra["occurrences"] = first.extra.get("occurrences", 1) + 1

    def encode(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def compare(self, left: str, right: str, probe: Probe, where: str, what: str,
                eot_start: int | None) -> bool:
        """Record a finding when `right` does not extend `left`; True when it does."""
        at = first_divergence(left, right)
        if at is None:
            return True
        rule, reason = _classify(left, right, at, probe, self.r.eos_token, eot_start)
        expected, caret = context_window(left, at)
        actual, _ = context_window(right, at)
        extra: JSONObject = {}
        if self.tokenizer is not None:
            extra = _token_divergence(self.tokenizer, self.encode(left), self.encode(right))
        self.add(Finding(rule, f"{reason}: {what}", f"{self.origin}: probe '{probe.name}', {where}",
                         at, expected, actual, caret, extra))
        return False

    def run(self, probe: Probe) -> bool:
        """Render one probe and check it; False when the template raised on it."""
        r, eos = self.r, self.r.eos_token
        messages = probe.prefix_messages()
        histories: list[tuple[str, int | None]] = []  # (render, index of its turn)
        turns: list[_Turn] = []
        try:
            for step in probe.steps:
                for obs in step.observations:
                    messages = messages + [obs]
                    histories.append((r.render(messages, False, probe.tools), None))
                prompt = r.render(messages, True, probe.tools)
                messages = messages + [step.reply.message]
                history = r.render(messages, False, probe.tools)
                histories.append((history, len(turns)))
                sampled, eot_len = _sampled_text(prompt, history, step.reply, eos)
                turns.append(_Turn(prompt, history, sampled, eot_len))
            for obs in probe.final_observations:
                messages = messages + [obs]
                histories.append((r.render(messages, False, probe.tools), None))
            final_prompt = r.render(messages, True, probe.tools)
        except RenderError as exc:
            self.failed = str(exc)
            return False
        _fill_end_of_turn(turns)
        # 1) (a) each history extends the previous one
        for n, ((before, k), (after, _)) in enumerate(pairwise(histories), start=1):
            eot = turns[k].eot_start if k is not None and turns[k].history.startswith(turns[k].prompt) else None
            self.compare(before, after, probe, f"history after message {n}",
                         "the history with one more message does not extend it", eot)
        next_prompts = [t.prompt for t in turns[1:]] + [final_prompt]
        for k, (turn, next_prompt) in enumerate(zip(turns, next_prompts), start=1):
            # 2) (b) the generation prompt is a prefix of the history with the reply
            self.compare(turn.prompt, turn.history, probe, f"turn {k}",
                         "the generation prompt is not a prefix of the history with the reply", None)
            if turn.sampled is None:
                continue
            # 3) (c) prompt + reply + end of turn is a prefix of the next prompt
            expected = turn.prompt + turn.sampled
            ok = self.compare(expected, next_prompt, probe, f"turn {k} -> {k + 1}",
                              "prompt + reply + end of turn is not a prefix of the next prompt",
                              turn.eot_start)
            if ok and self.tokenizer is not None:
                left_ids = self.encode(turn.prompt) + self.encode(turn.sampled)
                right_ids = self.encode(next_prompt)
                extra = _token_divergence(self.tokenizer, left_ids, right_ids)
                if extra:
                    self.add(Finding(
                        "PG110",
                        "the next prompt extends prompt + reply as text, but tokenizing it whole "
                        "gives other ids at the boundary; append the sampled ids instead of "
                        "re-tokenizing",
                        f"{self.origin}: probe '{probe.name}', turn {k} -> {k + 1}",
                        extra["first_divergence_token"], extra=extra))
        return True

    def date_check(self) -> bool:
        probe = probe_conversations()[1]  # system + plain
        messages = probe.prefix_messages() + probe.steps[0].observations
        try:
            a = self.r.render(messages, True, None, clock=CLOCK_A)
            b = self.r.render(messages, True, None, clock=CLOCK_B)
        except RenderError:
            a = b = ""
        if a != b:
            at = first_divergence(a, b)
            at = len(a) if at is None else at
            expected, caret = context_window(a, at)
            actual, _ = context_window(b, at)
            self.add(Finding("PG108", "the rendered prompt changes with the clock (two fixed clocks "
                             "render different text): every day starts a new cache prefix",
                             f"{self.origin}: probe '{probe.name}'", at, expected, actual, caret))
            return True
        if self.r.reads_date_statically:
            self.add(Finding("PG108", "the template reads a date (strftime_now / date variable); "
                             "callers that pass today's date change the prefix every day",
                             f"{self.origin}"))
            return True
        return False


def probe_template(template_str: str, bos_token: str | None = None, eos_token: str | None = None,
                   tokenizer: PreTrainedTokenizerBase | None = None, origin: str = "<template>") -> TemplateReport:
    """Render `template_str` over the probe conversations and report every break.

    Raises `LintInputError` when the template does not compile.
    """
    prober = _Prober(TemplateRenderer(template_str, bos_token, eos_token, origin), origin, tokenizer)
    checked: list[str] = []
    failures: dict[str, str] = {}
    for probe in probe_conversations():
        if prober.run(probe):
            checked.append(probe.name)
        else:
            failures[probe.name] = prober.failed
    for name, error in failures.items():
        plain_name = name.removeprefix("system+")
        if name.startswith("system+") and plain_name in checked:
            prober.add(Finding("PG106", f"the template raises on a system message ({error}); callers "
                               "then fold the system prompt into a user turn, often the last one",
                               f"{origin}: probe '{name}'"))
        else:
            prober.add(Finding("PG109", f"the template raised, so this probe was not checked: {error}",
                               f"{origin}: probe '{name}'"))
    reads_date = prober.date_check()
    findings = sorted(prober.findings.values(), key=lambda f: f.rule)
    append_only = not any(f.rule in BREAK_RULES for f in findings)
    return TemplateReport(origin, append_only, findings, reads_date, checked)
