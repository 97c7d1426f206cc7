"""How a model family writes tool calls in an assistant reply, both ways.

An OpenAI-compatible endpoint needs two things of a chat template's tool-call syntax:
`parse` turns a sampled reply's text into the calls it holds (and the content around
them), and `format` turns a client-written assistant message with `tool_calls` back
into the text the model would have written, so that it renders as a plain reply.
`parse(format(content, calls)) == (content.strip(), calls)` for every syntax.

Seven families, each named as vLLM's tool parsers name them. `base.py` holds what they
share (`ParsedCall`, `ToolCallSyntax`); `json_calls.py` the five whose calls are JSON
objects (`hermes`, `llama3_json`, `mistral`, `granite`, `phi4_mini_json`);
`harmony.py` gpt-oss's harmony messages (`gpt_oss`); `pythonic.py` OLMo 3's pythonic
calls (`olmo3`); `detect.py` `syntax_for_template`, which picks the family from markers
in a template's text, or None (the families without a syntax are listed there).
This package knows text only: nothing of tokens, tokenizers, tools' schemas or requests.
"""

from __future__ import annotations

from prefixgym.prompting.tool_syntax.base import ParsedCall, ToolCallSyntax
from prefixgym.prompting.tool_syntax.detect import syntax_for_template
from prefixgym.prompting.tool_syntax.harmony import GptOssSyntax
from prefixgym.prompting.tool_syntax.json_calls import (
    GraniteSyntax,
    HermesSyntax,
    Llama3JsonSyntax,
    MistralSyntax,
    Phi4MiniSyntax,
)
from prefixgym.prompting.tool_syntax.pythonic import Olmo3Syntax

__all__ = [
    "GptOssSyntax",
    "GraniteSyntax",
    "HermesSyntax",
    "Llama3JsonSyntax",
    "MistralSyntax",
    "Olmo3Syntax",
    "ParsedCall",
    "Phi4MiniSyntax",
    "ToolCallSyntax",
    "syntax_for_template",
]
