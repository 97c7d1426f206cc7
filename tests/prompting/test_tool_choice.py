"""`tool_choice` made to hold by a forced opening: what each choice forces, and the one
line a choice that cannot hold gets."""

from __future__ import annotations

import pytest

from prefixgym.prompting.tool_choice import ToolChoiceError, forced_opening
from prefixgym.prompting.tool_syntax import HermesSyntax, Olmo3Syntax, ToolCallSyntax

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
HERMES = HermesSyntax()


class CannotForce(ToolCallSyntax):
    """A syntax that keeps the base class's answer: no way to force a call."""

    name = "no_force"


@pytest.mark.parametrize(("choice", "opening"), [
    (None, ""), ("auto", ""), ("none", ""),
    ("required", '<tool_call>\n{"name": "'),
    ({"type": "function", "function": {"name": "calc"}},
     '<tool_call>\n{"name": "calc", "arguments":'),
    ({"type": "function", "name": "calc"}, '<tool_call>\n{"name": "calc", "arguments":'),
], ids=["absent", "auto", "none", "required", "chat-named", "responses-named"])
def test_each_choice_forces_its_opening(choice: object, opening: str) -> None:
    assert forced_opening(choice, [CALC], HERMES) == opening  # type: ignore[arg-type]


@pytest.mark.parametrize(("choice", "tools", "syntax", "words"), [
    ("required", [], HERMES, "'required' needs tools"),
    ({"type": "function", "function": {"name": "nope"}}, [CALC], HERMES,
     "'nope', which is not among the request's tools ('calc')"),
    ("any", [CALC], HERMES, "must be 'auto', 'none', 'required' or"),
    ({"type": "allowed_tools", "tools": []}, [CALC], HERMES, "must be 'auto'"),
    ("required", [CALC], None, "no tool-call syntax is known"),
    ("required", [CALC], CannotForce(), "cannot be forced in the 'no_force' tool-call syntax"),
    ({"type": "function", "function": {"name": "get-weather"}},
     [{"type": "function", "function": {"name": "get-weather"}}], Olmo3Syntax(),
     "the function 'get-weather' cannot be forced in the 'olmo3' tool-call syntax"),
])
def test_a_choice_that_cannot_hold_is_one_line(choice: object, tools: list, syntax: object,
                                               words: str) -> None:
    with pytest.raises(ToolChoiceError, match="tool_choice") as caught:
        forced_opening(choice, tools, syntax)  # type: ignore[arg-type]
    assert words in str(caught.value) and "\n" not in str(caught.value)
