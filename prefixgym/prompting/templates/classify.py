"""Why a rendered text stops extending the text it should extend: a rule and a reason.

The template probe (`append_only.py`) compares an expected text (an earlier render, or
prompt + sampled reply + end of turn) with a later render; at the first character
where they part, `classify` names the rule (PG101–PG107, PG111, PG112) and says why,
from where that character lies (inside the generation prompt, the reply, the end of
turn) and what the two sides hold there. Knows nothing of rendering or reporting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixgym.prompting.divergence import is_whitespace_change
from prefixgym.prompting.templates.probes import SYSTEM_TEXT
from prefixgym.prompting.templates.switches import Marker


@dataclass(frozen=True)
class Check:
    """One comparison made on a probe, and the landmarks of its expected text."""

    kind: str  # "history" (a), "prompt" (b) or "next" (c); see append_only.py
    what: str  # the sentence a finding ends with
    where: str  # "turn 1 -> 2, reply ending on '<|im_end|>'"
    conditions: dict[str, str] = field(default_factory=dict)  # dimension -> clause
    prompt_len: int | None = None  # len(P_k), for "prompt" and "next" checks
    opened: Marker | None = None  # the reasoning block P_k leaves open, where H_k drops it
    eot_start: int | None = None  # where the end of turn starts
    eot: str | None = None  # the end-of-turn token the reply ends on, when it does


@dataclass(frozen=True)
class ProbeFacts:
    """What the classifier needs to know of the probe itself."""

    has_system: bool
    reasonings: list[str]
    markers: list[Marker]
    eos: str


def tag_start(text: str, at: int) -> int:
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


def _snippet(text: str, at: int, size: int = 24) -> str:
    return repr(text[at : at + size] + ("..." if len(text) > at + size else ""))


def _reasoning(left: str, right: str, at: int, probe: ProbeFacts, check: Check) -> str | None:
    """The reason, when reasoning the expected text holds from `at` is missing later."""
    in_reply = check.kind == "next" and check.prompt_len is not None and at >= check.prompt_len
    whose = "of the reply is dropped once the turn is in the history" if in_reply \
        else "of an earlier turn is stripped from the history"
    for text in probe.reasonings:
        if text in left[at:] and text not in right:
            return f"the reasoning block {whose}"
    for marker in probe.markers:
        if left[at:].lstrip().startswith(marker.opener) and not right[at:].lstrip().startswith(marker.opener):
            return f"a {marker.opener} block {whose}"
    return None


def _in_reply(left: str, right: str, at: int, check: Check) -> tuple[str, str] | None:
    """PG112 / PG107 for a break inside the sampled reply or right at its end of turn."""
    if check.kind != "next" or check.prompt_len is None or check.eot_start is None:
        return None
    if not check.prompt_len <= at <= check.eot_start:
        return None
    if at == check.eot_start:
        if check.eot is None or not is_whitespace_change(left, right, at):
            return None
        gap = right[at : len(right) - len(right[at:].lstrip())]
        return "PG112", (f"the history puts {gap!r} between the reply and its end-of-turn token "
                         f"{check.eot!r}; a reply that ends on the token has none there")
    if is_whitespace_change(left, right, at):
        return "PG112", ("the template trims or changes the whitespace around the reply, so a "
                         "reply sampled with other whitespace renders differently in the history")
    return "PG107", "the reply is rendered differently in the history than it was sampled"


def classify(left: str, right: str, at: int, probe: ProbeFacts, check: Check) -> tuple[str, str]:
    """(rule, reason) for a break at `at` between the expected `left` and actual `right`."""
    at = tag_start(left, at)
    # 1) the generation prompt opened a reasoning block that the history does not keep
    if check.opened is not None and check.prompt_len is not None and check.kind in ("prompt", "next"):
        prompt = left[: check.prompt_len]
        opened_at = prompt.rfind(check.opened.opener)
        if 0 <= opened_at <= at <= check.prompt_len:
            return "PG111", (f"the generation prompt ends {prompt[opened_at:]!r} (an open "
                             f"{check.opened.opener} block) but the history renders that turn from "
                             f"there as {_snippet(right, opened_at)}")
    # 2) reasoning dropped, from earlier turns or from the reply itself
    reason = _reasoning(left, right, at, probe, check)
    if reason is not None:
        return "PG101", reason
    # 3) the system prompt moved
    if probe.has_system:
        was, now = left.find(SYSTEM_TEXT), right.find(SYSTEM_TEXT)
        if was >= 0 and now != was:
            where = "is dropped" if now < 0 else "moves to a later position"
            return "PG102", f"the system prompt {where} once the conversation grows"
    # 4) the sampled reply itself, or the whitespace before its end-of-turn token
    found = _in_reply(left, right, at, check)
    if found is not None:
        return found
    # 5) the end of turn, EOS, whitespace, anything else
    eos_at = _eos_spanning(left, right, at, probe.eos)
    if check.eot_start is not None and at >= check.eot_start:
        if eos_at is not None and eos_at > check.eot_start:
            return "PG104", f"EOS {probe.eos!r} is appended after the end of turn but not kept in history"
        if is_whitespace_change(left, right, at):
            return "PG105", "whitespace around the end of turn changes once the turn is in history"
        return "PG103", "the end of turn is rendered differently once the turn is in history"
    if eos_at is not None:
        return "PG104", f"EOS {probe.eos!r} is appended to the rendered history but not kept later"
    if is_whitespace_change(left, right, at):
        return "PG105", "whitespace changes between renders"
    return "PG107", "an earlier part of the conversation renders differently"
