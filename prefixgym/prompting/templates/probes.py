"""The probe conversations a chat template is rendered over, with replies that sample like models.

Each probe is a two-turn conversation (the messages the agent observes, then the
assistant's reply, twice) rendered one way: with or without a system message, with
or without tool definitions, with the template's defaults or one switch set (see
`switches.py`), and with one style of reply:

- `plain`: the answer as it is; `spaces` / `newlines`: the answer with spaces or
  newlines around it (models do sample those);
- `reasoning <think>` (one per marker the template knows): a reasoning block, then
  the answer;
- `tool-call`: a structured tool call, its result, then a plain answer.

What a model samples depends on where the generation prompt leaves it: after a
prompt that opens a reasoning block (`...<think>\\n`) it continues the reasoning,
closes the block and answers, and the reply's text is that continuation; after one
that closes an empty block (`<think>\\n\\n</think>\\n\\n`) it answers. `reply()` reads
the prompt and answers None for a style that does not fit it (that probe is then
not applicable). Each reply says which text the model sampled (`Reply.sampled`)
so that a template that renders the reply otherwise is caught.

This module is data and the rules that shape it; it renders nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixgym.prompting.templates.switches import DEFAULT, THINK, Marker, Setting
from prefixgym.types import JSONObject

SYSTEM_TEXT = "You are a careful assistant. Answer in one short sentence."
QUESTIONS = ("What is 2 + 2?", "And 3 + 3?")
ANSWERS = ("2 + 2 = 4.", "3 + 3 = 6.")
REASONING = ("The user adds two and two; that makes four.", "Three and three make six.")
TOOL_QUESTION = "What is the capital of France?"
TOOL_ANSWER = "The capital of France is Paris."
FINAL_USER = "Thanks!"

LOOKUP_TOOL: JSONObject = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a fact in the encyclopedia.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "What to look up."}},
            "required": ["query"],
        },
    },
}

# How each text style pads the answer.
_PADDING = {"plain": "", "spaces": " ", "newlines": "\n"}


@dataclass(frozen=True)
class Style:
    """How the assistant replies in one probe."""

    kind: str  # "plain" | "spaces" | "newlines" | "reasoning" | "tool-call"
    marker: Marker | None = None  # the reasoning block, for kind "reasoning"

    @property
    def name(self) -> str:
        return f"reasoning {self.marker.opener}" if self.marker else self.kind

    @property
    def clause(self) -> str:
        """The reply, as a condition a break may need: 'the reply contains a <think> block'."""
        if self.marker:
            return f"the reply contains a {self.marker.opener} block"
        return {"plain": "the reply is plain text", "spaces": "the reply has spaces around it",
                "newlines": "the reply has newlines around it",
                "tool-call": "the reply is a tool call"}[self.kind]


@dataclass(frozen=True)
class Reply:
    """An assistant message and the text a model sampled to produce it.

    `sampled` is what the model wrote after the generation prompt, before its
    end-of-turn token; None for a tool call, whose text the template decides."""

    message: JSONObject
    sampled: str | None
    reasoning: str | None = None
    continues: Marker | None = None  # the reasoning block the generation prompt opened


def _text_reply(text: str, reasoning: str | None = None) -> Reply:
    return Reply({"role": "assistant", "content": text}, sampled=text, reasoning=reasoning)


def _continuation(prompt: str, reasoning: str, closer: str, answer: str) -> str:
    """What a model samples after a prompt that opened a reasoning block."""
    lead = "" if prompt[-1:].isspace() else "\n"
    return f"{lead}{reasoning}\n{closer}\n\n{answer}"


def _tool_call_reply(prompt: str, opened: Marker | None) -> Reply:
    """A structured call; after a prompt that opened a reasoning block, its content is
    the rest of that block (the text before the call)."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "lookup", "arguments": {"query": "capital of France"}},
    }
    if opened is None:
        return Reply({"role": "assistant", "content": "", "tool_calls": [call]}, sampled=None)
    content = _continuation(prompt, REASONING[0], opened.closer, "")
    return Reply({"role": "assistant", "content": content, "tool_calls": [call]}, sampled=None,
                 reasoning=REASONING[0], continues=opened)


def prompt_state(prompt: str, markers: list[Marker]) -> tuple[str, Marker | None]:
    """("open", m) when the prompt ends inside block m, ("closed", m) right after one,
    else ("none", None)."""
    tail = prompt.rstrip()
    for marker in markers:
        if tail.endswith(marker.opener):
            return "open", marker
        if tail.endswith(marker.closer):
            return "closed", marker
    return "none", None


@dataclass(frozen=True)
class Probe:
    style: Style
    has_system: bool
    with_tools: bool
    setting: Setting = DEFAULT
    markers: list[Marker] = field(default_factory=lambda: [THINK], compare=False)

    @property
    def name(self) -> str:
        head = ("system+" if self.has_system else "") + ("tools+" if self.with_tools else "")
        tail = f" [{self.setting.label}]" if self.setting.label else ""
        return head + self.style.name + tail

    @property
    def tools(self) -> list[JSONObject] | None:
        return [LOOKUP_TOOL] if self.with_tools else None

    @property
    def num_steps(self) -> int:
        return 2

    def conditions(self) -> dict[str, str]:
        """What this probe varies, one clause per dimension (for "breaks only when ...")."""
        return {
            "setting": f"{self.setting.label} is passed" if self.setting.label
            else "the template's switches are left at their defaults",
            "system": "there is a system message" if self.has_system else "there is no system message",
            "tools": "tools are passed" if self.with_tools else "no tools are passed",
            "reply": self.style.clause,
        }

    def prefix_messages(self) -> list[JSONObject]:
        return [{"role": "system", "content": SYSTEM_TEXT}] if self.has_system else []

    def observations(self, step: int) -> list[JSONObject]:
        if self.style.kind == "tool-call":
            if step == 0:
                return [{"role": "user", "content": TOOL_QUESTION}]
            return [{"role": "tool", "name": "lookup", "tool_call_id": "call_0", "content": "Paris"}]
        return [{"role": "user", "content": QUESTIONS[step]}]

    def final_observations(self) -> list[JSONObject]:
        return [{"role": "user", "content": FINAL_USER}]

    def reply(self, step: int, prompt: str) -> Reply | None:
        """The reply a model samples after `prompt` in this probe; None when the style
        does not fit the prompt (a plain reply inside an opened reasoning block)."""
        kind, marker = self.style.kind, self.style.marker
        state, opened = prompt_state(prompt, self.markers)
        if kind == "tool-call" and step == 0:
            return _tool_call_reply(prompt, opened if state == "open" else None)
        answer = TOOL_ANSWER if kind == "tool-call" else ANSWERS[step]
        if state == "open":
            # 1) the prompt opened a block: only the probe of that block's reasoning (and
            #    the tool-call probe's answer) continues it; it closes the block and answers
            if kind not in ("reasoning", "tool-call") or (marker is not None and marker != opened):
                return None
            assert opened is not None
            text = _continuation(prompt, REASONING[step], opened.closer, answer)
            return Reply({"role": "assistant", "content": text}, sampled=text,
                         reasoning=REASONING[step], continues=opened)
        if kind == "reasoning":
            # 2) after a closed (empty) block the model answers without reasoning
            if state == "closed" or marker is None:
                return None
            return _text_reply(f"{marker.opener}\n{REASONING[step]}\n{marker.closer}\n\n{answer}",
                               reasoning=REASONING[step])
        pad = _PADDING.get(kind, "")
        return _text_reply(f"{pad}{answer}{pad}")


def probe_conversations(markers: list[Marker] | None = None,
                        settings: list[Setting] | None = None) -> list[Probe]:
    """Every probe: for each setting (the defaults first), {no system, system} x
    {no tools, tools} x {plain, each reasoning block, spaces, newlines}, then the
    tool-call probe with tools, without and with a system message."""
    markers = markers or [THINK]
    styles = [Style("plain"), *(Style("reasoning", m) for m in markers),
              Style("spaces"), Style("newlines")]
    probes = []
    for setting in [DEFAULT, *(settings or [])]:
        for style in styles:
            for with_tools in (False, True):
                for has_system in (False, True):
                    probes.append(Probe(style, has_system, with_tools, setting, markers))
        for has_system in (False, True):
            probes.append(Probe(Style("tool-call"), has_system, True, setting, markers))
    return probes
