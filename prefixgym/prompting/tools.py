"""Tools at the text level: specs, deterministic schema JSON, calls and their parsing.

The specs (`Tool`, `@tool`, `ToolLike`, `as_tool`, `as_tools`, `tools_json`) are
`tool_spec.py`'s, imported from here too. This module is the calls: in the built-in
format an assistant calls a tool by writing
`<tool_call>{"name": "...", "arguments": {...}}</tool_call>` in its reply.
`parse_tool_calls` finds every such block and never raises: a block that cannot be
used becomes a structured `ToolCallError`.

This module knows text only: nothing of tokens, chat formats or envs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Literal

import pydantic
from pydantic import BaseModel

from prefixgym.prompting.tool_spec import (
    Tool,
    ToolLike,
    as_tool,
    as_tools,
    tool,
    tools_json,
    validation_summary,
)
from prefixgym.types import JSONObject

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolLike",
    "as_tool",
    "as_tools",
    "format_tool_call",
    "parse_tool_calls",
    "tool",
    "tools_json",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class ToolCall(BaseModel):
    """One well-formed call of a known tool with valid arguments (as written)."""

    name: str
    arguments: JSONObject


class ToolCallError(BaseModel):
    """A `<tool_call>` block that cannot be run, and why."""

    kind: Literal["malformed_json", "unknown_tool", "invalid_arguments"]
    message: str
    raw: str
    name: str | None = None


def format_tool_call(name: str, arguments: JSONObject) -> str:
    """The text of one tool call, exactly as the assistant should write it."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def parse_tool_calls(text: str, tools: Iterable[ToolLike]) -> list[ToolCall | ToolCallError]:
    """Every `<tool_call>...</tool_call>` block in `text`, in order. Never raises on the
    text (only on `tools` that are not tools, as `as_tools` does).

    An unclosed block is malformed_json; so is a block that is not a JSON object with
    a string "name" and an object "arguments" (which may be omitted)."""
    by_name = {t.name: t for t in as_tools(tools)}
    results: list[ToolCall | ToolCallError] = []
    if not isinstance(text, str):
        return [ToolCallError(kind="malformed_json", message="reply is not text", raw=repr(text))]
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end == -1:
            results.append(ToolCallError(
                kind="malformed_json", message=f"unclosed {TOOL_CALL_OPEN}: missing "
                f"{TOOL_CALL_CLOSE}", raw=text[body_start:]))
            break
        results.append(_parse_one(text[body_start:end], by_name))
        pos = end + len(TOOL_CALL_CLOSE)
    return results


def _parse_one(raw: str, by_name: dict[str, Tool]) -> ToolCall | ToolCallError:
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return ToolCallError(kind="malformed_json", message=f"invalid JSON: {e}", raw=raw)
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCallError(kind="malformed_json", raw=raw,
                             message='expected a JSON object with a string "name"')
    name = payload["name"]
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallError(kind="malformed_json", raw=raw, name=name,
                             message='"arguments" must be a JSON object')
    if name not in by_name:
        known = ", ".join(sorted(by_name)) or "none"
        return ToolCallError(kind="unknown_tool", raw=raw, name=name,
                             message=f"unknown tool {name!r} (known: {known})")
    try:
        by_name[name].args_model.model_validate(arguments)
    except pydantic.ValidationError as e:
        return ToolCallError(kind="invalid_arguments", raw=raw, name=name,
                             message=f"invalid arguments for {name!r}: {validation_summary(e)}")
    except Exception as e:  # a user validator that raises something else
        return ToolCallError(kind="invalid_arguments", raw=raw, name=name,
                             message=f"invalid arguments for {name!r}: {e}")
    return ToolCall(name=name, arguments=arguments)
