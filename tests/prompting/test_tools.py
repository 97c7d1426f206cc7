"""Tool specs, deterministic schema JSON, tool-call formatting and parsing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from prefixgym.prompting.hf_template import hf_tools
from prefixgym.prompting.tools import (
    Tool,
    ToolCall,
    ToolCallError,
    as_tool,
    as_tools,
    format_tool_call,
    parse_tool_calls,
    tool,
    tools_json,
)


@tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Longer explanation that is still part of the description.

    Args:
        a: The first
            addend.
        b (int): The second addend.

    Returns:
        The sum.
    """
    return a + b


@tool
def explode(x: str) -> str:
    """Always fails."""
    raise RuntimeError(f"boom {x}")


class Lookup(BaseModel):
    """Look up the value stored under a key."""

    key: str = Field(description="The key to look up.")


LOOKUP = Tool.from_model(Lookup, fn=lambda key: {"k1": "v1"}.get(key, "missing"))
TOOLS = [add, explode, LOOKUP]

SCRIPT = """
from prefixgym.prompting.tools import tool, tools_json, Tool
from pydantic import BaseModel, Field
@tool
def add(a: int, b: int = 2) -> int:
    '''Add two integers.

    Longer explanation that is still part of the description.

    Args:
        a: The first
            addend.
        b (int): The second addend.

    Returns:
        The sum.
    '''
    return a + b
class Lookup(BaseModel):
    '''Look up the value stored under a key.'''
    key: str = Field(description="The key to look up.")
print(tools_json([add, Tool.from_model(Lookup)]), end="")
"""


def test_from_function_reads_docstring_and_signature() -> None:
    schema = add.schema()
    assert schema["name"] == "add"
    assert schema["description"] == (
        "Add two integers. Longer explanation that is still part of the description."
    )
    params = schema["parameters"]
    assert params["properties"]["a"] == {"type": "integer", "description": "The first addend."}
    assert params["properties"]["b"]["default"] == 2
    assert params["properties"]["b"]["description"] == "The second addend."
    assert params["required"] == ["a"]
    assert "title" not in json.dumps(params)


def test_from_model_uses_model_name_and_docstring() -> None:
    schema = LOOKUP.schema()
    assert schema["name"] == "lookup"
    assert schema["description"] == "Look up the value stored under a key."
    assert schema["parameters"]["properties"]["key"]["description"] == "The key to look up."
    assert LOOKUP.call({"key": "k1"}) == "v1"


def test_tools_json_is_compact_sorted_and_stable_across_processes() -> None:
    text = tools_json([add, Tool.from_model(Lookup)])
    assert text == tools_json([add, Tool.from_model(Lookup)])
    assert ": " not in text and ", " not in text.replace(", e.g.", "")
    decoded = json.loads(text)
    assert [t["name"] for t in decoded] == ["add", "lookup"]
    assert json.dumps(decoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False) == text
    outputs = {
        subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert outputs == {text}


def test_tools_json_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match="duplicate tool names"):
        tools_json([add, add])


def test_bad_tool_definitions_raise_value_error() -> None:
    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    def varargs(*xs: int) -> int:
        return 0

    with pytest.raises(ValueError, match="needs a type annotation"):
        Tool.from_function(untyped)
    with pytest.raises(ValueError, match="plain or keyword-only"):
        Tool.from_function(varargs)
    with pytest.raises(ValueError, match="tool name"):
        Tool.from_function(lambda: 0, name="bad name")


def test_round_trip_format_then_parse() -> None:
    text = "I will add. " + format_tool_call("add", {"a": 3, "b": 4}) + " and look up " + (
        format_tool_call("lookup", {"key": "ünï"})
    )
    assert parse_tool_calls(text, TOOLS) == [
        ToolCall(name="add", arguments={"a": 3, "b": 4}),
        ToolCall(name="lookup", arguments={"key": "ünï"}),
    ]


@pytest.mark.parametrize(
    ("body", "kind", "name"),
    [
        ("{not json", "malformed_json", None),
        ('["add", 1]', "malformed_json", None),
        ('{"arguments": {}}', "malformed_json", None),
        ('{"name": "add", "arguments": [1]}', "malformed_json", "add"),
        ('{"name": "sub", "arguments": {"a": 1}}', "unknown_tool", "sub"),
        ('{"name": "add", "arguments": {"b": 1}}', "invalid_arguments", "add"),
        ('{"name": "add", "arguments": {"a": "x"}}', "invalid_arguments", "add"),
        ('{"name": "add", "arguments": {"a": 1, "c": 2}}', "invalid_arguments", "add"),
    ],
)
def test_bad_calls_give_structured_errors(body: str, kind: str, name: str | None) -> None:
    [result] = parse_tool_calls(f"x <tool_call>{body}</tool_call> y", TOOLS)
    assert isinstance(result, ToolCallError)
    assert (result.kind, result.name, result.raw) == (kind, name, body)
    assert result.message


def test_unclosed_tool_call_is_malformed_json() -> None:
    results = parse_tool_calls(
        format_tool_call("add", {"a": 1}) + '<tool_call>{"name": "add"', TOOLS
    )
    assert isinstance(results[0], ToolCall)
    assert isinstance(results[1], ToolCallError)
    assert results[1].kind == "malformed_json" and "unclosed" in results[1].message
    assert parse_tool_calls("no calls here </tool_call>", TOOLS) == []


def test_call_runs_function_and_reports_errors_as_text() -> None:
    assert add.call({"a": 1}) == "3"
    assert add.call_with_status({"a": 1, "b": 5}) == ("6", True)
    text, ok = explode.call_with_status({"x": "now"})
    assert not ok and text.startswith("Error:") and "RuntimeError: boom now" in text
    text, ok = add.call_with_status({"a": "nope"})
    assert not ok and "invalid arguments" in text
    assert not Tool.from_model(Lookup).call_with_status({"key": "k"})[1]  # no function


@given(st.text(max_size=200))
def test_parse_never_raises_on_random_text(text: str) -> None:
    for piece in (text, "<tool_call>" + text, "<tool_call>" + text + "</tool_call>"):
        for result in parse_tool_calls(piece, TOOLS):
            assert isinstance(result, (ToolCall, ToolCallError))


def test_parse_survives_deep_nesting_and_huge_text() -> None:
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    [result] = parse_tool_calls(deep, TOOLS)
    assert isinstance(result, ToolCallError) and result.kind == "malformed_json"
    assert parse_tool_calls("a" * 1_000_000, TOOLS) == []


def plain_add(a: int, b: int = 2) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def test_functions_and_models_convert_exactly_as_tool_and_from_model() -> None:
    converted = as_tools([plain_add, Lookup, LOOKUP])
    assert converted[0].schema() == tool(plain_add).schema()
    assert converted[1].schema() == Tool.from_model(Lookup).schema()
    assert converted[2] is LOOKUP
    assert converted[0].call({"a": 1}) == "3"
    assert as_tool(plain_add).fn is plain_add
    # every tools= argument takes them: JSON, HF tool dicts, call parsing
    assert tools_json([plain_add, Lookup]) == tools_json([tool(plain_add), Tool.from_model(Lookup)])
    assert hf_tools([plain_add]) == [{"type": "function", "function": tool(plain_add).schema()}]
    assert hf_tools([]) is None
    call = format_tool_call("plain_add", {"a": 4})
    assert parse_tool_calls(call, [plain_add]) == [ToolCall(name="plain_add", arguments={"a": 4})]


@pytest.mark.parametrize(("value", "message"), [
    ([3], r"tools\[0\] is int, expected a prefixgym Tool, a typed function or a pydantic model"),
    ([add, dict], r"tools\[1\] is the class dict, expected"),
    ([{"type": "function"}], r"tools\[0\] is dict, expected"),
    ([lambda x: x], r"tools\[0\]: tool '<lambda>': parameter 'x' needs a type annotation"),
    ([lambda: 0], r"tools\[0\]: tool name must match"),
    ([len], r"tools\[0\]: tool 'len': parameter 'obj' must be a plain or keyword-only"),
    (plain_add, r"tools must be a list of tools, got function"),
    ("lookup", r"tools must be a list of tools, got str"),
])
def test_anything_else_is_a_one_line_value_error(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        as_tools(value)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
