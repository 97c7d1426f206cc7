"""What shape of message content a chat template reads: plain strings, or lists of typed parts.

Text-only templates print `message['content']` as a string. Multimodal ones (the chat
templates of vision-language models) loop over it as a list of parts, `{"type": "text",
"text": ...}` beside images, and print a plain string as nothing at all. Probes written
in the wrong shape judge a template that never showed their text, so `read_shapes`
renders a short conversation both ways and keeps, for each role, the shape whose
rendering shows that role's text (plain strings where both do, or neither); `shaped`
writes messages that way. Knows nothing of probes or of what a break is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

from prefixgym.prompting.templates.jinja_render import RenderError
from prefixgym.types import JSONObject

ContentShape = Literal["strings", "parts"]
ROLES = ("system", "user", "assistant", "tool")
STRINGS: dict[str, ContentShape] = dict.fromkeys(ROLES, "strings")

# One text per role, each unlikely to be printed by a template on its own.
_SAMPLES: list[list[JSONObject]] = [
    [{"role": "user", "content": "Shape probe: a user asks."},
     {"role": "assistant", "content": "Shape probe: the assistant answers."},
     {"role": "user", "content": "Shape probe: the user goes on."}],
    [{"role": "system", "content": "Shape probe: the system speaks."},
     {"role": "user", "content": "Shape probe: a user asks."}],
]


def as_parts(content: object) -> object:
    """A string as one text part (the empty string too: templates index `content[0]`)."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def shaped(messages: list[JSONObject], shapes: Mapping[str, ContentShape]) -> list[JSONObject]:
    """`messages` with the content of each role whose shape is "parts" as a list of parts
    (a role the map does not name follows the user's)."""
    if all(shape == "strings" for shape in shapes.values()):
        return messages
    return [{**m, "content": as_parts(m.get("content"))}
            if shapes.get(str(m.get("role")), shapes.get("user")) == "parts" else m
            for m in messages]


def _shown(render: Callable[[list[JSONObject]], str], shape: ContentShape) -> set[str]:
    """The roles whose sample text the rendering shows, every message in `shape`."""
    shown = set()
    for sample in _SAMPLES:
        try:
            text = render(shaped(sample, dict.fromkeys(ROLES, shape)))
        except RenderError:
            continue
        shown |= {str(m["role"]) for m in sample if str(m["content"]) in text}
    return shown


def read_shapes(render: Callable[[list[JSONObject]], str]) -> dict[str, ContentShape]:
    """Per role, the content shape the template prints: "strings" where a plain string
    shows, else "parts" where a text part does, else "strings". Tool results follow the
    user's shape (the samples hold no tool call for a result to answer)."""
    as_strings = _shown(render, "strings")
    in_parts = _shown(render, "parts") - as_strings if len(as_strings) < 3 else set()
    shapes: dict[str, ContentShape] = {
        role: "parts" if role in in_parts else "strings" for role in ROLES[:3]}
    shapes["tool"] = shapes["user"]
    return shapes


def describe(shapes: Mapping[str, ContentShape]) -> str:
    """'plain strings', 'lists of text parts', or which roles got which."""
    kinds = set(shapes.values())
    if kinds == {"strings"}:
        return "plain strings"
    if kinds == {"parts"}:
        return 'lists of {"type": "text"} parts'
    parts = sorted(role for role, shape in shapes.items() if shape == "parts")
    return f'lists of {{"type": "text"}} parts for {", ".join(parts)}, plain strings otherwise'
