"""What a request's `tool_choice` makes the reply begin with: `forced_opening`.

Without a grammar engine a server can still make a tool choice hold the way a chat
template would have it: it writes the opening of the call for the model, in the model's
own tool-call syntax, and lets the model write the rest. Those forced tokens belong to
the prompt (never trained, no logprobs); what the model samples after them is the reply,
so the tokens trained are still exactly the tokens sampled.
  - "auto", "none" or no choice: nothing is forced ("");
  - "required": the opening up to where a function's name goes, so that the model picks
    one of the tools (Hermes: `<tool_call>\\n{"name": "`);
  - a function (`{"type": "function", "function": {"name": f}}`, or the Responses API's
    `{"type": "function", "name": f}`): the opening through f's name and the start of its
    arguments (`<tool_call>\\n{"name": "f", "arguments":`).
`ToolChoiceError` (a ValueError), one line, for a choice that cannot hold: no tools, a
function not among them, a syntax that is not known or cannot write that call
(`ToolCallSyntax.forced_opening`).
Knows OpenAI's `tool_choice` and `tools` shapes and the syntaxes' openings; not tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixgym.prompting.tool_syntax import ToolCallSyntax
from prefixgym.types import JSONObject

NOT_FORCED = ("auto", "none")


class ToolChoiceError(ValueError):
    """A `tool_choice` that cannot hold, in one line."""


def forced_opening(tool_choice: str | JSONObject | None, tools: Sequence[JSONObject],
                   syntax: ToolCallSyntax | None) -> str:
    """The text the reply is made to begin with for `tool_choice` ("" when none)."""
    if tool_choice is None or tool_choice in NOT_FORCED:
        return ""
    name = _chosen_name(tool_choice)
    what = "'required'" if name is None else f"the function {name!r}"
    if not tools:
        raise ToolChoiceError(f"tool_choice {what} needs tools; the request has none")
    names = [_tool_name(t) for t in tools]
    if name is not None and name not in names:
        raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not among "
                              f"the request's tools ({', '.join(map(repr, names))})")
    if syntax is None:
        raise ToolChoiceError(f"tool_choice {what} cannot be forced: no tool-call syntax "
                              "is known for this model's chat template")
    opening = syntax.forced_opening(name)
    if opening is None:
        raise ToolChoiceError(f"tool_choice {what} cannot be forced in the {syntax.name!r} "
                              "tool-call syntax; send 'auto' or leave it out")
    return opening


def _chosen_name(tool_choice: str | JSONObject) -> str | None:
    """None for "required", the function's name for a named choice; ToolChoiceError else."""
    if tool_choice == "required":
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise ToolChoiceError("tool_choice must be 'auto', 'none', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}, got "
                          f"{_short(tool_choice)}")


def _tool_name(tool: JSONObject) -> str | None:
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) else None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
