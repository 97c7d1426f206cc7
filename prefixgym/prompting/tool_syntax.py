"""How a model family writes tool calls in an assistant reply, both ways.

An OpenAI-compatible endpoint needs two things of a chat template's tool-call syntax:
`parse` turns a sampled reply's text into the calls it holds (and the content around
them), and `format` turns a client-written assistant message with `tool_calls` back
into the text the model would have written, so that it renders as a plain reply.
`parse(format(content, calls)) == (content.strip(), calls)` for every syntax.

Four families, each named as vLLM's tool parsers name them:

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks
  (Qwen2.5, Qwen3, Hermes, ...). The built-in ChatML format writes the same blocks
  without the newlines (`tools.format_tool_call`); both parse.
- `llama3_json`: a reply that is `{"name": ..., "parameters": {...}}` objects, split by
  `;`, optionally after `<|python_tag|>` (Llama 3.1, 3.2, 3.3).
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` when the template shows `[ARGS]`; both parse.
- `gpt_oss`: harmony messages `<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{...}<|call|>`, read from text decoded with its special tokens kept.

`syntax_for_template` picks the family from markers in a template's text, or None.
This module knows text only: nothing of tokens, tokenizers, tools' schemas or requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from prefixgym.prompting.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, format_tool_call
from prefixgym.types import JSONObject

__all__ = [
    "GptOssSyntax",
    "HermesSyntax",
    "Llama3JsonSyntax",
    "MistralSyntax",
    "ParsedCall",
    "ToolCallSyntax",
    "syntax_for_template",
]

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?")
_HARMONY_CALL = re.compile(
    r"(?:<\|start\|>assistant)?"
    r"(?:<\|channel\|>(?:commentary|analysis)\s+to=functions\.(?P<name>[^\s<]+)"
    r"|\s*to=functions\.(?P<role_name>[^\s<]+)\s*<\|channel\|>(?:commentary|analysis))"
    r"[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<body>.*?)(?:<\|call\|>|<\|end\|>|\Z)",
    re.DOTALL,
)
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    """One tool call as a reply writes it: a function name and its JSON arguments."""

    name: str
    arguments: JSONObject


class _Span(NamedTuple):
    """text[start:end] is tool-call syntax that holds `calls` (one or more, in order)."""

    start: int
    end: int
    calls: list[ParsedCall]


class ToolCallSyntax:
    """One family's tool-call syntax. A family overrides `find_calls` and `format`."""

    name: ClassVar[str]

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content outside the calls, the calls in order). The content is stripped when
        calls were found and is `text` unchanged otherwise; a block that is not valid JSON
        or has no string name stays in the content. Never raises."""
        spans = self.find_calls(text)
        if not spans:
            return text, []
        pieces: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        for span in spans:
            pieces.append(text[pos:span.start])
            calls.extend(span.calls)
            pos = span.end
        pieces.append(text[pos:])
        return "".join(pieces).strip(), calls

    def find_calls(self, text: str) -> list[_Span]:
        """The well-formed call syntax in `text`, in order, without overlaps."""
        raise NotImplementedError

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        """The assistant text the model writes for `content` (stripped) and `calls`."""
        raise NotImplementedError


@dataclass(frozen=True)
class HermesSyntax(ToolCallSyntax):
    """`<tool_call>` blocks; `compact` writes them as the built-in format does."""

    name: ClassVar[str] = "hermes"
    compact: bool = False

    def find_calls(self, text: str) -> list[_Span]:
        spans: list[_Span] = []
        pos = 0
        while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
            body = _skip_space(text, start + len(TOOL_CALL_OPEN))
            decoded = _decode_at(text, body)
            if decoded is not None:
                close = _skip_space(text, decoded[1])
                call = _call_from(decoded[0])
                if call is not None and text.startswith(TOOL_CALL_CLOSE, close):
                    pos = close + len(TOOL_CALL_CLOSE)
                    spans.append(_Span(start, pos, [call]))
                    continue
            end = text.find(TOOL_CALL_CLOSE, body)
            if end == -1:
                break
            pos = end + len(TOOL_CALL_CLOSE)
        return spans

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        if self.compact:
            blocks = [format_tool_call(c.name, c.arguments) for c in calls]
        else:
            blocks = [f"{TOOL_CALL_OPEN}\n{_call_json(c)}\n{TOOL_CALL_CLOSE}" for c in calls]
        return "\n".join(_nonempty(content) + blocks)


@dataclass(frozen=True)
class Llama3JsonSyntax(ToolCallSyntax):
    """A reply that is call objects split by `;`: all of them calls, or none is read."""

    name: ClassVar[str] = "llama3_json"

    def find_calls(self, text: str) -> list[_Span]:
        tag = text.find(PYTHON_TAG)
        start = tag if tag != -1 else _skip_space(text, 0)
        pos = tag + len(PYTHON_TAG) if tag != -1 else start
        if tag == -1 and not text.startswith("{", start):
            return []
        calls: list[ParsedCall] = []
        end = pos
        while (decoded := _decode_at(text, _skip_space(text, pos))) is not None:
            call = _call_from(decoded[0], ("parameters", "arguments"))
            if call is None:
                return []
            calls.append(call)
            end = decoded[1]
            separator = _skip_space(text, end)
            if not text.startswith(";", separator):
                break
            pos = separator + 1
        return [_Span(start, end, calls)] if calls else []

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        if not calls:
            return content.strip()
        body = "; ".join(
            json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False)
            for c in calls
        )
        # Llama templates drop content beside a call; the tag keeps it apart when given.
        return f"{content.strip()}{PYTHON_TAG}{body}" if content.strip() else body


@dataclass(frozen=True)
class MistralSyntax(ToolCallSyntax):
    """`[TOOL_CALLS]` then a JSON array, or (`args_form`) `name[ARGS]{...}` per call."""

    name: ClassVar[str] = "mistral"
    args_form: bool = False

    def find_calls(self, text: str) -> list[_Span]:
        spans: list[_Span] = []
        pos = 0
        while (start := text.find(MISTRAL_TOOL_CALLS, pos)) != -1:
            pos = start + len(MISTRAL_TOOL_CALLS)
            found = self._calls_after(text, pos)
            if found is not None:
                calls, pos = found
                spans.append(_Span(start, pos, calls))
        return spans

    @staticmethod
    def _calls_after(text: str, pos: int) -> tuple[list[ParsedCall], int] | None:
        """The calls written right after a `[TOOL_CALLS]` that ends at `pos`, and their end."""
        array_at = _skip_space(text, pos)
        if text.startswith("[", array_at):
            decoded = _decode_at(text, array_at)
            if decoded is None or not isinstance(decoded[0], list) or not decoded[0]:
                return None
            calls = [_call_from(item) for item in decoded[0]]
            valid = [c for c in calls if c is not None]
            return (valid, decoded[1]) if len(valid) == len(calls) else None
        named = _MISTRAL_NAMED.match(text, pos)
        decoded = _decode_at(text, named.end()) if named else None
        if named is None or decoded is None or not isinstance(decoded[0], dict):
            return None
        return [ParsedCall(named.group(1), decoded[0])], decoded[1]

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        if not calls:
            return content.strip()
        if self.args_form:
            body = "".join(f"{MISTRAL_TOOL_CALLS}{c.name}{MISTRAL_ARGS}"
                           f"{json.dumps(c.arguments, ensure_ascii=False)}" for c in calls)
        else:
            body = f"{MISTRAL_TOOL_CALLS} [{', '.join(_call_json(c) for c in calls)}]"
        return content.strip() + body


@dataclass(frozen=True)
class GptOssSyntax(ToolCallSyntax):
    """Harmony messages addressed `to=functions.NAME`, in either header order.

    Content is the raw harmony text outside the calls (analysis and final messages
    included, with their special tokens): splitting channels is not this class's job."""

    name: ClassVar[str] = "gpt_oss"

    def find_calls(self, text: str) -> list[_Span]:
        spans: list[_Span] = []
        for match in _HARMONY_CALL.finditer(text):
            name = match.group("name") or match.group("role_name")
            arguments = _loads(match.group("body").strip())
            if name and isinstance(arguments, dict):
                spans.append(_Span(match.start(), match.end(), [ParsedCall(name, arguments)]))
        return spans

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        text = content.strip()
        for call in calls:
            # The generation prompt already opened the first message when nothing precedes it.
            text += "<|start|>assistant" if text else ""
            text += (f"<|channel|>commentary to=functions.{call.name} <|constrain|>json"
                     f"<|message|>{json.dumps(call.arguments, ensure_ascii=False)}<|call|>")
        return text


def syntax_for_template(template: str | None, builtin: bool = False) -> ToolCallSyntax | None:
    """The tool-call syntax a chat template's text implies; None when it is unknown.

    `builtin=True` (prefixgym's own ChatML format) is hermes in the built-in form, as is
    a template that shows `<tool_call>{` without a newline between (the built-in one).
    Markers are checked from the most specific up: a Qwen template also holds
    `<|im_start|>`, a Llama 3.x one `<|start_header_id|>`, neither decides alone."""
    if builtin:
        return HermesSyntax(compact=True)
    if not template:
        return None
    if "<|channel|>" in template and "functions." in template and "to=" in template:
        return GptOssSyntax()
    if MISTRAL_TOOL_CALLS in template:
        return MistralSyntax(args_form=MISTRAL_ARGS in template)
    if TOOL_CALL_OPEN in template:
        # Qwen3-Coder (`<function=...>`) and GLM-4.5 (`<arg_key>`) put XML, not JSON, inside.
        if "<function=" in template or "<arg_key>" in template:
            return None
        return HermesSyntax(compact=TOOL_CALL_OPEN + "{" in template)
    llama_markers = (PYTHON_TAG, "Given the following functions", '"parameters"')
    if "<|start_header_id|>" in template and any(m in template for m in llama_markers):
        return Llama3JsonSyntax()
    return None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    """(the JSON value that starts at text[pos], where it ends), or None."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def _loads(text: str) -> Any:  # any JSON value, or None when text is not JSON
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call_from(
    payload: Any, argument_keys: tuple[str, ...] = ("arguments",)
) -> ParsedCall | None:
    """A call from a decoded `{"name": str, <argument key>: object}`; arguments may be absent."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments: Any = next((payload[k] for k in argument_keys if k in payload), {})
    if not payload["name"] or not isinstance(arguments, dict):
        return None
    return ParsedCall(payload["name"], arguments)


def _call_json(call: ParsedCall) -> str:
    """`{"name": ..., "arguments": ...}` as a template's `tojson` writes it."""
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)


def _nonempty(content: str) -> list[str]:
    return [content.strip()] if content.strip() else []
