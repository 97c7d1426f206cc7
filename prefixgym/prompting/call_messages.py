"""A chat call's messages as the call tree compares and renders them.

OpenAI's message shapes (chat completions: `developer` roles, content parts, tool calls
with JSON-string arguments, tool results that name their call by id) become
`CallMessage`s (`call_messages`), and a sampled reply's text becomes the assistant
message a client gets back (`reply_message`: its reasoning apart, its tool calls read
in the model's syntax). Knows messages and tool-call syntaxes; nothing of tokens,
chat formats or the tree (`call_tree.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prefixgym.prompting.tool_syntax import ParsedCall, ToolCallSyntax
from prefixgym.types import JSONObject

CALL_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class CallMessage:
    """One message of a call, as the tree compares and renders it."""

    role: str
    content: str
    name: str | None = None
    """A tool result's tool name (resolved from its `tool_call_id`)."""
    tool_calls: tuple[ParsedCall, ...] = ()

    @property
    def key(self) -> str:
        """What makes two messages the same turn: role, text (an assistant's without the
        whitespace around it, which clients trim), tool name, and each call's name and
        arguments (call ids are the client's bookkeeping, never rendered here)."""
        text = self.content.strip() if self.role == "assistant" else self.content
        calls = [[c.name, c.arguments] for c in self.tool_calls]
        return json.dumps([self.role, text, self.name, calls], sort_keys=True,
                          ensure_ascii=False)


def call_messages(messages: Iterable[JSONObject]) -> list[CallMessage]:
    """OpenAI chat messages as the tree reads them: `developer` is `system`, content
    parts are joined, a tool result takes its tool's name from the call it answers, and
    a call's `arguments` (a JSON string, or an object) become an object.
    ValueError names the message at fault."""
    out: list[CallMessage] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in CALL_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {CALL_ROLES}, got {role!r}")
        calls = tuple(_parsed_call(c, f"messages[{i}].tool_calls[{k}]", names)
                      for k, c in enumerate(m.get("tool_calls") or []))
        name = m.get("name")
        if role == "tool":
            name = names.get(str(m.get("tool_call_id")), name)
        out.append(CallMessage(str(role), _text(m.get("content")), name if role == "tool" else None,
                               calls))
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _parsed_call(call: Any, where: str, names: dict[str, str]) -> ParsedCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name', "
                         "'arguments'}}")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"{where}.function.arguments is not valid JSON") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    if isinstance(call.get("id"), str):
        names[call["id"]] = function["name"]
    return ParsedCall(function["name"], arguments)


def reply_message(text: str, syntax: ToolCallSyntax | None, with_tools: bool,
                  split_reasoning: bool = True) -> tuple[CallMessage, str | None]:
    """The assistant message a client gets for a sampled reply's text, and its reasoning:
    a leading `<think>...</think>` block goes apart (vLLM's `reasoning_content`) unless
    not `split_reasoning`, and with tools the calls written in the model's syntax
    become `tool_calls`."""
    reasoning = None
    if split_reasoning and "</think>" in text:
        head, _, text = text.partition("</think>")
        reasoning, text = head.replace("<think>", "", 1).strip(), text.lstrip("\n")
    calls: list[ParsedCall] = []
    if with_tools and syntax is not None:
        text, calls = syntax.parse(text)
    return CallMessage("assistant", text, None, tuple(calls)), reasoning

