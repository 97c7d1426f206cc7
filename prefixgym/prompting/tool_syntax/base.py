"""What every family's tool-call syntax shares: a parsed call, a span of call syntax in
a reply, and `ToolCallSyntax`, whose `parse` splits a reply into content and calls.

A family overrides two methods: `find_calls` says where its calls lie in a reply's text
(and what they hold), `format` writes calls back as the model would have; and
`forced_opening`, the start of a call a server writes for the model when a request's
`tool_choice` demands one (None, the default: this family cannot be made to call). `parse` is
written once, here, from `find_calls`, so that
`parse(format(content, calls)) == (content.strip(), calls)` holds for every family that
keeps its `find_calls` and `format` in step. This module knows no family and no markers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from prefixgym.types import JSONObject


@dataclass(frozen=True)
class ParsedCall:
    """One tool call as a reply writes it: a function name and its JSON arguments."""

    name: str
    arguments: JSONObject


class CallSpan(NamedTuple):
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

    def find_calls(self, text: str) -> list[CallSpan]:
        """The well-formed call syntax in `text`, in order, without overlaps."""
        raise NotImplementedError

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        """The assistant text the model writes for `content` (stripped) and `calls`."""
        raise NotImplementedError

    def forced_opening(self, name: str | None) -> str | None:
        """The text a reply is made to begin with so that it writes a call: `format("",
        [call of name])` up to and including the name and the start of its arguments,
        or, for `name` None (any tool), up to where the name goes. It ends where the
        model's own next token would begin (no trailing space), and `parse` reads the
        call once the model has written the rest. None: this syntax cannot force that
        call (a name it cannot write, or no way to force at all)."""
        return None
