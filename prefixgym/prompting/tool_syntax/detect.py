"""Which tool-call syntax a chat template implies: `syntax_for_template`.

It picks the family from markers in a template's text, or answers None. Families
without one, for which it answers None (and the endpoint a 400 for a request with
tools): Gemma 2 and 3, OLMo 2, Phi-3, Phi-3.5 and Phi-4 (14B), whose templates know no
tools; Phi-4-mini's official template, which reads tools from a system message's
`tools` string (not the `tools` argument) and renders no calls; Qwen3-Coder
(`<function=...>`) and GLM-4.5 (`<arg_key>`), whose XML parameters hold untyped text
that only the tools' schemas could read back. This module reads a template's text only:
it never renders one, and knows nothing of how a family parses or formats its calls.
"""

from __future__ import annotations

from prefixgym.prompting.tool_syntax.base import ToolCallSyntax
from prefixgym.prompting.tool_syntax.harmony import GptOssSyntax
from prefixgym.prompting.tool_syntax.json_calls import (
    GRANITE_TOOL_CALL,
    MISTRAL_ARGS,
    MISTRAL_TOOL_CALLS,
    PHI4_MINI_TOOL_CALL_END,
    PYTHON_TAG,
    GraniteSyntax,
    HermesSyntax,
    Llama3JsonSyntax,
    MistralSyntax,
    Phi4MiniSyntax,
)
from prefixgym.prompting.tool_syntax.pythonic import FUNCTION_CALLS_OPEN, Olmo3Syntax
from prefixgym.prompting.tools import TOOL_CALL_OPEN


def syntax_for_template(template: str | None, builtin: bool = False) -> ToolCallSyntax | None:
    """The tool-call syntax a chat template's text implies; None when it is unknown.

    `builtin=True` (prefixgym's own ChatML format) is hermes in the built-in form, as is
    a template that shows `<tool_call>{` without a newline between (the built-in one).
    Markers are checked from the most specific up: a Qwen or OLMo 3 template also holds
    `<|im_start|>`, a Llama 3.x one `<|start_header_id|>`, a Granite 4 one (hermes)
    `<|start_of_role|>`; none of those decides alone."""
    if builtin:
        return HermesSyntax(compact=True)
    if not template:
        return None
    if "<|channel|>" in template and "functions." in template and "to=" in template:
        return GptOssSyntax()
    if MISTRAL_TOOL_CALLS in template:
        return MistralSyntax(args_form=MISTRAL_ARGS in template)
    if GRANITE_TOOL_CALL in template:
        if "<|start_of_role|>" in template:
            return GraniteSyntax()
        return Phi4MiniSyntax() if PHI4_MINI_TOOL_CALL_END in template else None
    if FUNCTION_CALLS_OPEN in template:
        return Olmo3Syntax()
    if TOOL_CALL_OPEN in template:
        # Qwen3-Coder (`<function=...>`) and GLM-4.5 (`<arg_key>`) put XML, not JSON, inside.
        if "<function=" in template or "<arg_key>" in template:
            return None
        return HermesSyntax(compact=TOOL_CALL_OPEN + "{" in template)
    llama_markers = (PYTHON_TAG, "Given the following functions", '"parameters"')
    if "<|start_header_id|>" in template and any(m in template for m in llama_markers):
        return Llama3JsonSyntax()
    return None
