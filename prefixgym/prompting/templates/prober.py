"""Render one probe conversation and check it; every break becomes a `Sighting`.

For each turn k of a probe, rendered with its setting at a fixed clock:
  1) (a) each rendered history extends the previous one (one message more);
  2) (b) the generation prompt P_k is a prefix of the history H_k that ends with
     the reply;
  3) (c) P_k + S_k + end of turn is a prefix of the next generation prompt, where
     S_k is the separator + the text the model sampled (`Reply.sampled`): once with
     the reply ending on its end-of-turn token (`stop_token`: the closing's, or EOS
     where the closing is text without one), once ending without it and closed
     by the template's closing. Separator and closing are read off a plain reply
     under the same setting (`Shape`), never off the reply being checked, so a
     template that trims or rewrites that reply is caught.
A sighting records where it was seen, under which conditions (one clause per
dimension the probes vary), and why (`classify.py`). `append_only.py` turns sightings
into findings. Knows nothing of files, reports or output formats.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

from prefixgym.prompting.divergence import context_window, first_divergence
from prefixgym.prompting.templates.classify import Check, ProbeFacts, classify
from prefixgym.prompting.templates.content import STRINGS, ContentShape, shaped
from prefixgym.prompting.templates.probes import Probe, Reply, prompt_state
from prefixgym.prompting.templates.render import RenderError, TemplateRenderer
from prefixgym.prompting.templates.switches import Marker, Setting
from prefixgym.types import JSONObject

if TYPE_CHECKING:  # a tokenizer is optional here; transformers loads only with one
    from transformers import PreTrainedTokenizerBase

_TAG = re.compile(r"<[^<>\s]{1,40}>|\[/?[A-Za-z_]{1,20}\]")
_CANONICAL_KINDS = ("plain", "reasoning", "tool-call")  # replies a shape may be read off


@dataclass
class Sighting:
    """One break seen in one check of one probe."""

    rule: str
    reason: str
    what: str
    location: str
    conditions: dict[str, str]
    setting: Setting
    first_divergence: int | None = None
    expected: str | None = None
    actual: str | None = None
    caret: int | None = None
    extra: JSONObject = field(default_factory=dict)
    check: str = ""
    """The check's kind: "history" (a), "prompt" (b) or "next" (c)."""


def end_of_turn_token(closing: str, eos: str) -> str | None:
    """The token a reply ends on, read off the closing: EOS or the first tag of it."""
    body = closing.lstrip()
    if eos and body.startswith(eos):
        return eos
    tag = _TAG.match(body)
    if tag:
        return tag.group(0)
    return eos if eos and eos in closing else None


@dataclass(frozen=True)
class Shape:
    """How a template frames a reply: the separator before it and the closing after it."""

    separator: str
    closing: str


@dataclass
class _Turn:
    """One step of a rendered probe."""

    prompt: str  # P_k
    history: str  # H_k
    reply: Reply
    sampled: str | None  # separator + what the model sampled; None when it cannot be told
    closing: str | None  # what closes the turn when the reply does not end on its token

    @property
    def history_eot_start(self) -> int | None:
        """Where the end of turn starts in H_k, when H_k holds P_k + the sampled text."""
        if self.sampled is None:
            return None
        head = self.prompt + self.sampled
        return len(head) if self.history.startswith(head) else None


def stop_token(turn: _Turn, eos: str) -> str | None:
    """The token the model stops a reply on: the closing's end-of-turn token; EOS when
    the closing is text that holds none (a template that writes ' ' or '\\n\\n' after a
    reply, as single-turn QA templates do: the model still stopped on EOS, which the
    next prompt must then keep); None when not known (an empty closing, where the next
    message's header may be the stop token, or a tool call, whose stop is the template's)."""
    if turn.closing is None:
        return eos or None
    token = end_of_turn_token(turn.closing, eos)
    if token is None and turn.closing and turn.reply.sampled is not None:
        return eos or None
    return token


def read_shape(prompt: str, history: str, sampled: str) -> Shape | None:
    """Separator and closing around `sampled` in H_k, when H_k holds it after P_k."""
    if not history.startswith(prompt):
        return None
    rest = history[len(prompt):]
    at = rest.find(sampled)
    if at < 0:
        return None
    separator = rest[:at] if rest[:at].isspace() else ""
    return Shape(separator, rest[at + len(sampled):])


def _tool_call_text(prompt: str, history: str, shape: Shape | None, eos: str) -> tuple[str | None, str | None]:
    """(sampled, closing) of a tool-call turn, read off H_k: the template decides its text."""
    if not history.startswith(prompt):
        return None, None
    rest = history[len(prompt):]
    for closing in (shape.closing if shape else None, eos):
        if closing and closing in rest:
            return rest[: rest.find(closing)], closing
    body = rest.rstrip()
    return body, rest[len(body):]


def _token_divergence(tokenizer: PreTrainedTokenizerBase, left_ids: list[int], right_ids: list[int]) -> JSONObject:
    at = first_divergence(left_ids, right_ids)
    if at is None:
        return {}
    left, right = left_ids[at : at + 4], right_ids[at : at + 4]
    return {"first_divergence_token": at, "expected_ids": left, "actual_ids": right,
            "expected_tokens": tokenizer.convert_ids_to_tokens(left),
            "actual_tokens": tokenizer.convert_ids_to_tokens(right)}


class Prober:
    """Runs probes over one renderer; keeps every sighting and what the checks varied."""

    def __init__(self, renderer: TemplateRenderer, origin: str, markers: list[Marker],
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 content: Mapping[str, ContentShape] = STRINGS) -> None:
        self.r = renderer
        self.content = content  # the shape each role's content is written in
        self.origin = origin
        self.markers = markers
        self.tokenizer = tokenizer
        self.shapes: dict[Setting, Shape] = {}
        self.sightings: list[Sighting] = []
        # setting -> dimension -> the clauses of the checks made under that setting
        self.seen: dict[Setting, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.failed = ""

    def _encode(self, text: str) -> list[int]:
        assert self.tokenizer is not None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def compare(self, left: str, right: str, probe: Probe, facts: ProbeFacts, check: Check) -> bool:
        """Record a sighting when `right` does not extend `left`; True when it does."""
        for dimension, clause in check.conditions.items():
            self.seen[probe.setting][dimension].add(clause)
        at = first_divergence(left, right)
        if at is None:
            return True
        rule, reason = classify(left, right, at, facts, check)
        expected, caret = context_window(left, at)
        actual, _ = context_window(right, at)
        # what the break costs: the cached text after it is prefilled again next turn
        extra: JSONObject = {"reprefilled_chars_per_turn": len(left) - at}
        if self.tokenizer is not None:
            left_ids = self._encode(left)
            extra.update(_token_divergence(self.tokenizer, left_ids, self._encode(right)))
            extra["reprefilled_tokens_per_turn"] = len(left_ids) - extra.get(
                "first_divergence_token", len(left_ids))
        self.sightings.append(Sighting(
            rule, reason, check.what, f"{self.origin}: probe '{probe.name}', {check.where}",
            check.conditions, probe.setting, at, expected, actual, caret, extra, check.kind))
        return False

    def _render(self, probe: Probe, messages: list[JSONObject], generation: bool) -> str:
        return self.r.render(shaped(messages, self.content), generation, probe.tools,
                             variables=probe.setting.kwargs())

    def _turn(self, probe: Probe, prompt: str, history: str, reply: Reply) -> _Turn:
        """P_k and H_k with what the model sampled, framed by the setting's shape."""
        shape = self.shapes.get(probe.setting)
        if reply.sampled is None:
            sampled, closing = _tool_call_text(prompt, history, shape, self.r.eos_token)
            return _Turn(prompt, history, reply, sampled, closing)
        if shape is None and (probe.style.kind in _CANONICAL_KINDS or reply.continues):
            shape = read_shape(prompt, history, reply.sampled)
            if shape is not None:
                self.shapes[probe.setting] = shape
        if shape is None:
            return _Turn(prompt, history, reply, reply.sampled, None)
        return _Turn(prompt, history, reply, shape.separator + reply.sampled, shape.closing)

    def run(self, probe: Probe) -> str:
        """Render one probe and check it: "checked", "failed" (the template raised;
        `failed` says how) or "not applicable" (a reply style the prompt rules out)."""
        messages = probe.prefix_messages()
        histories: list[tuple[str, int | None]] = []  # (render, index of its turn)
        turns: list[_Turn] = []
        try:
            for step in range(probe.num_steps):
                for obs in probe.observations(step):
                    messages = messages + [obs]
                    histories.append((self._render(probe, messages, False), None))
                prompt = self._render(probe, messages, True)
                reply = probe.reply(step, prompt)
                if reply is None:
                    return "not applicable"
                messages = messages + [reply.message]
                history = self._render(probe, messages, False)
                histories.append((history, len(turns)))
                turns.append(self._turn(probe, prompt, history, reply))
            for obs in probe.final_observations():
                messages = messages + [obs]
                histories.append((self._render(probe, messages, False), None))
            final_prompt = self._render(probe, messages, True)
        except RenderError as exc:
            self.failed = str(exc)
            return "failed"
        self._check(probe, histories, turns, final_prompt)
        return "checked"

    def _check(self, probe: Probe, histories: list[tuple[str, int | None]], turns: list[_Turn],
               final_prompt: str) -> None:
        eos = self.r.eos_token
        reasonings = [t.reply.reasoning for t in turns if t.reply.reasoning]
        facts = ProbeFacts(probe.has_system, reasonings, self.markers, eos)
        conditions = probe.conditions()
        # 1) (a) each history extends the previous one
        for n, ((before, k), (after, _)) in enumerate(pairwise(histories), start=1):
            eot_start = turns[k].history_eot_start if k is not None else None
            self.compare(before, after, probe, facts, Check(
                "history", "the history with one more message does not extend it",
                f"history after message {n}", conditions, eot_start=eot_start))
        next_prompts = [t.prompt for t in turns[1:]] + [final_prompt]
        for k, (turn, next_prompt) in enumerate(zip(turns, next_prompts), start=1):
            _, opened = prompt_state(turn.prompt, self.markers)
            opened = opened if turn.reply.continues else None
            dropped = opened if not turn.history.startswith(turn.prompt) else None
            # 2) (b) the generation prompt is a prefix of the history with the reply
            self.compare(turn.prompt, turn.history, probe, facts, Check(
                "prompt", "the generation prompt is not a prefix of the history with the reply",
                f"turn {k}", conditions, prompt_len=len(turn.prompt), opened=opened))
            if turn.sampled is None:
                continue
            # 3) (c) prompt + sampled reply + end of turn is a prefix of the next prompt
            eot = stop_token(turn, eos)
            endings: list[tuple[str | None, str, str]] = []  # (eot token, closing text, clause)
            if eot is not None:
                endings.append((eot, eot, f"the reply ends on its end-of-turn token {eot!r}"))
            if turn.closing is not None:
                endings.append((None, turn.closing, "the reply ends without its end-of-turn token"))
            for token, closing, clause in endings:
                expected = turn.prompt + turn.sampled + closing
                ending = f"reply ending on {token!r}" if token else "reply closed by the template"
                ok = self.compare(expected, next_prompt, probe, facts, Check(
                    "next", "prompt + reply + end of turn is not a prefix of the next prompt",
                    f"turn {k} -> {k + 1}, {ending}", {**conditions, "end": clause},
                    prompt_len=len(turn.prompt), opened=dropped,
                    eot_start=len(turn.prompt) + len(turn.sampled), eot=token))
                if ok and token is None and self.tokenizer is not None:
                    self._token_check(probe, k, turn.prompt, expected, next_prompt, conditions)

    def _token_check(self, probe: Probe, k: int, prompt: str, expected: str, next_prompt: str,
                     conditions: dict[str, str]) -> None:
        """PG110: the text extends, but tokenizing the next prompt whole gives other ids."""
        left_ids = self._encode(prompt) + self._encode(expected[len(prompt):])
        extra = _token_divergence(self.tokenizer, left_ids, self._encode(next_prompt)) \
            if self.tokenizer is not None else {}
        if extra:
            self.sightings.append(Sighting(
                "PG110",
                "the next prompt extends prompt + reply as text, but tokenizing it whole gives "
                "other ids at the boundary; append the sampled ids instead of re-tokenizing",
                "", f"{self.origin}: probe '{probe.name}', turn {k} -> {k + 1}", conditions,
                probe.setting, extra["first_divergence_token"], extra=extra, check="next"))
