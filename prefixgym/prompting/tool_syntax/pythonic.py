"""OLMo 3's tool calls: pythonic calls in a `<function_calls>` block, family `olmo3`.

`<function_calls>name(key=<JSON value>, ...)\\n...</function_calls>`, one call a line
(OLMo 3 and 3.1 Instruct), read with `ast`, never evaluated: each argument is a JSON
value, or a Python literal (`true`/`false`/`null` read too), and a block that holds
anything else stays in the content. A call whose tool name or argument names are not
Python names (`get-weather`, `from=`) cannot be read back and stays in the content.
This module knows text only: nothing of tokens or tools' schemas.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from dataclasses import dataclass
from keyword import iskeyword
from typing import Any, ClassVar

from prefixgym.prompting.tool_syntax.base import CallSpan, ParsedCall, ToolCallSyntax
from prefixgym.types import JSONObject

FUNCTION_CALLS_OPEN = "<function_calls>"
FUNCTION_CALLS_CLOSE = "</function_calls>"


@dataclass(frozen=True)
class Olmo3Syntax(ToolCallSyntax):
    """`<function_calls>` blocks of pythonic calls, one a line, each argument a JSON value
    (Python literals and `true`/`false`/`null` read too); a block that holds anything
    else stays in the content."""

    name: ClassVar[str] = "olmo3"

    def find_calls(self, text: str) -> list[CallSpan]:
        spans: list[CallSpan] = []
        pos = 0
        while (start := text.find(FUNCTION_CALLS_OPEN, pos)) != -1:
            body = start + len(FUNCTION_CALLS_OPEN)
            ends = _occurrences(text, FUNCTION_CALLS_CLOSE, body, _CLOSE_TAGS_TRIED)
            if not ends:
                break
            # A close tag inside a string argument does not end the block: the next may.
            found = next(((end, calls) for end in ends
                          if (calls := _pythonic_calls(text[body:end]))), None)
            pos = (found[0] if found else ends[0]) + len(FUNCTION_CALLS_CLOSE)
            if found:
                spans.append(CallSpan(start, pos, found[1]))
        return spans

    def format(self, content: str, calls: Sequence[ParsedCall]) -> str:
        if not calls:
            return content.strip()
        body = "\n".join(
            f"{c.name}({', '.join(f'{k}={_json(v)}' for k, v in c.arguments.items())})"
            for c in calls)
        return f"{content.strip()}{FUNCTION_CALLS_OPEN}{body}{FUNCTION_CALLS_CLOSE}"

    def forced_opening(self, name: str | None) -> str | None:
        if name is None:
            return FUNCTION_CALLS_OPEN
        if not all(part.isidentifier() and not iskeyword(part)
                   for part in name.split(".")):
            return None  # `find_calls` reads (dotted) Python names only
        return f"{FUNCTION_CALLS_OPEN}{name}("


# Each try parses the block again; a reply that repeats the tag must not cost n^2.
_CLOSE_TAGS_TRIED = 4


def _occurrences(text: str, sub: str, start: int, limit: int) -> list[int]:
    found: list[int] = []
    while len(found) < limit and (at := text.find(sub, start)) != -1:
        found.append(at)
        start = at + len(sub)
    return found


def _pythonic_calls(body: str) -> list[ParsedCall] | None:
    """The calls of `f(a=1)` lines, or None when the body holds anything else."""
    source = "\n".join(line.strip() for line in body.splitlines())
    try:
        calls = [_pythonic_call(s, source) for s in ast.parse(source).body]
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return calls or None


def _pythonic_call(statement: ast.stmt, source: str) -> ParsedCall:
    call = statement.value if isinstance(statement, ast.Expr) else None
    if not isinstance(call, ast.Call) or call.args:
        raise ValueError("not a call with keyword arguments only")
    arguments: JSONObject = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs")
        text = ast.get_source_segment(source, keyword.value)
        try:  # JSON as the template writes it; the slower literal walk otherwise
            arguments[keyword.arg] = json.loads(text or "")
        except (ValueError, RecursionError):
            arguments[keyword.arg] = _literal(keyword.value)
    return ParsedCall(_dotted_name(call.func), arguments)


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise ValueError("a call's name must be a (dotted) Python name")


_JSON_NAMES: dict[str, Any] = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """The JSON value a Python literal (or `true`/`false`/`null`) spells; ValueError else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, type(None))):
        return node.value  # bool is an int
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("an object's keys must be strings")
        return {k: _literal(v) for k, v in zip(keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = node.operand.value if isinstance(node.operand, ast.Constant) else None
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    raise ValueError("not a literal")


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
