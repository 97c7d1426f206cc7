"""The families whose calls are JSON objects `{"name": ..., "arguments": {...}}`, told
apart by what frames them. Named as vLLM's tool parsers name them:

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks
  (Qwen2.5, Qwen3, Qwen3-MoE, SmolLM3, Granite 4, Hermes, ...). The built-in ChatML
  format writes the same blocks without the newlines (`tools.format_tool_call`).
- `llama3_json`: a reply that is `{"name": ..., "parameters": {...}}` objects, split by
  `;`, optionally after `<|python_tag|>` (Llama 3.1, 3.2, 3.3).
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` when the template shows `[ARGS]`; both parse.
- `granite`: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (Granite 3.0 to 3.3,
  whose templates name the token and render a call as the reply's text).
- `phi4_mini_json`: the same array closed by `<|/tool_call|>` (Phi-4-mini's two tokens),
  known from a template that writes `<|tool_call|>`; the official one has no syntax
  (`detect.py`).

A call that is not valid JSON, or has no string name, stays in the content. This module
knows text only: not which template implies which family (`detect.py`), nor tokens or
tools' schemas.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from prefixgym.prompting.tool_syntax.base import CallSpan, ParsedCall, ToolCallSyntax
from prefixgym.prompting.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, format_tool_call

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
GRANITE_TOOL_CALL = "<|tool_call|>"
PHI4_MINI_TOOL_CALL_END = "<|/tool_call|>"
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_MISTRAL_NAMED = re.compile(rf"({_MISTRAL_NAME.pattern})(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class HermesSyntax(ToolCallSyntax):
    """`<tool_call>` blocks; `compact` writes them as the built-in format does."""

    name: ClassVar[str] = "hermes"
    compact: bool = False

    def find_calls(self, text: str) -> list[CallSpan]:
        spans: list[CallSpan] = []
        pos = 0
        while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
            body = _skip_space(text, start + len(TOOL_CALL_OPEN))
            decoded = _decode_at(text, body)
            if decoded is not None:
                close = _skip_space(text, decoded[1])
                call = _call_from(decoded[0])
                if call is not None and text.startswith(TOOL_CALL_CLOSE, close):
                    pos = close + len(TOOL_CALL_CLOSE)
                    spans.append(CallSpan(start, pos, [call]))
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

    def forced_opening(self, name: str | None) -> str | None:
        newline = "" if self.compact else "\n"
        return f"{TOOL_CALL_OPEN}{newline}{_json_opening(name, 'arguments')}"


@dataclass(frozen=True)
class Llama3JsonSyntax(ToolCallSyntax):
    """A reply that is call objects split by `;`: all of them calls, or none is read."""

    name: ClassVar[str] = "llama3_json"

    def find_calls(self, text: str) -> list[CallSpan]:
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
        return [CallSpan(start, end, calls)] if calls else []

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        if not calls:
            return content.strip()
        body = "; ".join(
            json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False)
            for c in calls
        )
        # Llama templates drop content beside a call; the tag keeps it apart when given.
        return f"{content.strip()}{PYTHON_TAG}{body}" if content.strip() else body

    def forced_opening(self, name: str | None) -> str | None:
        return _json_opening(name, "parameters")


@dataclass(frozen=True)
class MistralSyntax(ToolCallSyntax):
    """`[TOOL_CALLS]` then a JSON array, or (`args_form`) `name[ARGS]{...}` per call."""

    name: ClassVar[str] = "mistral"
    args_form: bool = False

    def find_calls(self, text: str) -> list[CallSpan]:
        spans: list[CallSpan] = []
        pos = 0
        while (start := text.find(MISTRAL_TOOL_CALLS, pos)) != -1:
            pos = start + len(MISTRAL_TOOL_CALLS)
            found = self._calls_after(text, pos)
            if found is not None:
                calls, pos = found
                spans.append(CallSpan(start, pos, calls))
        return spans

    @staticmethod
    def _calls_after(text: str, pos: int) -> tuple[list[ParsedCall], int] | None:
        """The calls written right after a `[TOOL_CALLS]` that ends at `pos`, and their end."""
        array_at = _skip_space(text, pos)
        if text.startswith("[", array_at):
            decoded = _decode_at(text, array_at)
            calls = _call_list(decoded[0]) if decoded and isinstance(decoded[0], list) else None
            return (calls, decoded[1]) if decoded and calls else None
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

    def forced_opening(self, name: str | None) -> str | None:
        if not self.args_form:
            return f"{MISTRAL_TOOL_CALLS} [{_json_opening(name, 'arguments')}"
        if name is None:
            return MISTRAL_TOOL_CALLS
        if not _MISTRAL_NAME.fullmatch(name):
            return None  # `find_calls` could not read the name back
        return f"{MISTRAL_TOOL_CALLS}{name}{MISTRAL_ARGS}"


@dataclass(frozen=True)
class GraniteSyntax(ToolCallSyntax):
    """`<|tool_call|>` then a JSON array of calls (one bare object reads too), then `end`
    when the family writes one (it need not be there to parse: sampling may stop first)."""

    name: ClassVar[str] = "granite"
    end: str = ""

    def find_calls(self, text: str) -> list[CallSpan]:
        spans: list[CallSpan] = []
        pos = 0
        while (start := text.find(GRANITE_TOOL_CALL, pos)) != -1:
            pos = start + len(GRANITE_TOOL_CALL)
            decoded = _decode_at(text, _skip_space(text, pos))
            calls = _call_list(decoded[0], ("arguments", "parameters")) if decoded else None
            if decoded and calls:
                pos = decoded[1]
                end_at = _skip_space(text, pos)
                if self.end and text.startswith(self.end, end_at):
                    pos = end_at + len(self.end)
                spans.append(CallSpan(start, pos, calls))
        return spans

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        if not calls:
            return content.strip()
        body = ", ".join(_call_json(c) for c in calls)
        return f"{content.strip()}{GRANITE_TOOL_CALL}[{body}]{self.end}"

    def forced_opening(self, name: str | None) -> str | None:
        return f"{GRANITE_TOOL_CALL}[{_json_opening(name, 'arguments')}"


@dataclass(frozen=True)
class Phi4MiniSyntax(GraniteSyntax):
    """Granite's array closed by `<|/tool_call|>`, as Phi-4-mini writes it (its calls may
    name their arguments `parameters`, as Microsoft's own runtime asks: both read)."""

    name: ClassVar[str] = "phi4_mini_json"
    end: str = PHI4_MINI_TOOL_CALL_END


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


def _call_list(
    value: Any, argument_keys: tuple[str, ...] = ("arguments",)
) -> list[ParsedCall] | None:
    """The calls of a decoded non-empty array of call objects (or of one object); None
    unless every item is a call."""
    items = value if isinstance(value, list) else [value]
    calls = [c for item in items if (c := _call_from(item, argument_keys)) is not None]
    return calls if items and len(calls) == len(items) else None


def _call_json(call: ParsedCall) -> str:
    """`{"name": ..., "arguments": ...}` as a template's `tojson` writes it."""
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)


def _json_opening(name: str | None, arguments_key: str) -> str:
    """`{"name": "` (any tool), or `{"name": "f", "<arguments_key>":` (f's call)."""
    if name is None:
        return '{"name": "'
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{arguments_key}":'


def _nonempty(content: str) -> list[str]:
    return [content.strip()] if content.strip() else []
