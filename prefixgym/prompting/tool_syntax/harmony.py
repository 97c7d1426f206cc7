"""gpt-oss's tool calls: harmony messages addressed to a function, family `gpt_oss`.

A call is `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
(the recipient may also stand before the channel), read from text decoded with its
special tokens kept. The arguments are one JSON object; a message that holds anything
else stays in the content. This module knows text only: not harmony's other channels
(analysis and final messages stay in the content, special tokens and all), nor tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from prefixgym.prompting.tool_syntax.base import CallSpan, ParsedCall, ToolCallSyntax

_HARMONY_CALL = re.compile(
    r"(?:<\|start\|>assistant)?"
    r"(?:<\|channel\|>(?:commentary|analysis)\s+to=functions\.(?P<name>[^\s<]+)"
    r"|\s*to=functions\.(?P<role_name>[^\s<]+)\s*<\|channel\|>(?:commentary|analysis))"
    r"[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<body>.*?)(?:<\|call\|>|<\|end\|>|\Z)",
    re.DOTALL,
)


_HARMONY_NAME = re.compile(r"[^\s<]+")


@dataclass(frozen=True)
class GptOssSyntax(ToolCallSyntax):
    """Harmony messages addressed `to=functions.NAME`, in either header order.

    Content is the raw harmony text outside the calls (analysis and final messages
    included, with their special tokens): splitting channels is not this class's job."""

    name: ClassVar[str] = "gpt_oss"

    def find_calls(self, text: str) -> list[CallSpan]:
        spans: list[CallSpan] = []
        for match in _HARMONY_CALL.finditer(text):
            name = match.group("name") or match.group("role_name")
            arguments = _loads(match.group("body").strip())
            if name and isinstance(arguments, dict):
                spans.append(CallSpan(match.start(), match.end(), [ParsedCall(name, arguments)]))
        return spans

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        text = content.strip()
        for call in calls:
            # The generation prompt already opened the first message when nothing precedes it.
            text += "<|start|>assistant" if text else ""
            text += (f"<|channel|>commentary to=functions.{call.name} <|constrain|>json"
                     f"<|message|>{json.dumps(call.arguments, ensure_ascii=False)}<|call|>")
        return text

    def forced_opening(self, name: str | None) -> str | None:
        # The generation prompt ends with `<|start|>assistant`: the call is its first message.
        if name is None:
            return "<|channel|>commentary to=functions."
        if not _HARMONY_NAME.fullmatch(name):
            return None  # a space or `<` would end the recipient early
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"


def _loads(text: str) -> Any:  # any JSON value, or None when text is not JSON
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
