"""Tool specs: a name, a description, a pydantic model of the arguments, a function.

A `Tool` is built from a typed function (the docstring gives the description, its
Google-style "Args:" section the per-argument descriptions), from a pydantic model,
or from OpenAI's JSON form. Every `tools=` argument in prefixgym takes a `ToolLike`: a
Tool, a typed function or a pydantic model class, converted by `as_tools` exactly as
`@tool` and `Tool.from_model` do. `tools_json` is the schemas' one deterministic JSON.

Knows Python functions, pydantic and JSON schemas; nothing of the text a model writes
to call a tool (`tools.py`), of tokens, chat formats or envs.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, overload

import pydantic
from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from prefixgym.types import JSONObject

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
_SECTION_RE = re.compile(r"^(Args|Arguments|Parameters|Returns?|Raises|Yields?|Examples?|Notes?"
                         r"|Attributes|See Also|Warnings?|Todo)\s*:\s*$")
_ARG_LINE_RE = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


@dataclass(frozen=True)
class Tool:
    """A callable tool: `fn` is called with one keyword argument per field of `args_model`."""

    name: str
    description: str
    args_model: type[BaseModel]
    fn: Callable[..., Any] | None = None  # a user's function: any signature
    parameters: JSONObject | None = field(default=None, compare=False, hash=False)
    """The arguments' JSON schema as a client sent it (`from_openai`): `schema()` gives it
    back unchanged instead of deriving one from `args_model`."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"tool name must match {_NAME_RE.pattern}, got {self.name!r}")
        if not (isinstance(self.args_model, type) and issubclass(self.args_model, BaseModel)):
            raise ValueError(f"tool {self.name!r}: args_model must be a pydantic BaseModel class")

    @classmethod
    def from_function(
        cls, fn: Callable[..., Any], name: str | None = None, description: str | None = None
    ) -> Tool:
        """Build a tool from a typed function; every parameter needs a type annotation."""
        tool_name: str = name or str(getattr(fn, "__name__", ""))
        doc_description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        try:
            hints = typing.get_type_hints(fn)
        except Exception as e:  # an annotation that does not resolve
            raise ValueError(f"tool {tool_name!r}: cannot resolve type hints: {e}") from e
        fields: dict[str, tuple[object, FieldInfo]] = {}
        for param in inspect.signature(fn).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                raise ValueError(
                    f"tool {tool_name!r}: parameter {param.name!r} must be a plain or "
                    "keyword-only parameter (no *args, **kwargs or positional-only)"
                )
            if param.name not in hints:
                raise ValueError(
                    f"tool {tool_name!r}: parameter {param.name!r} needs a type annotation"
                )
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (
                hints[param.name],
                Field(default, description=arg_docs.get(param.name)),
            )
        unknown = sorted(set(arg_docs) - set(fields))
        if unknown:
            raise ValueError(
                f"tool {tool_name!r}: docstring documents unknown arguments {unknown}"
            )
        args_model = pydantic.create_model(  # type: ignore[call-overload]
            _camel(tool_name) + "Args", __config__=ConfigDict(extra="forbid"), **fields
        )
        return cls(tool_name, description or doc_description, args_model, fn)

    @classmethod
    def from_model(
        cls,
        model_cls: type[BaseModel],
        fn: Callable[..., Any] | None = None,
        name: str | None = None,
        description: str | None = None,
    ) -> Tool:
        """Build a tool from a pydantic model of its arguments.

        The name defaults to the snake_case model name, the description to the
        model's docstring; `fn`, if given, is called with the fields as keywords."""
        if not (isinstance(model_cls, type) and issubclass(model_cls, BaseModel)):
            raise ValueError(f"from_model needs a pydantic BaseModel class, got {model_cls!r}")
        tool_name = name or _snake(model_cls.__name__)
        doc = inspect.getdoc(model_cls) or ""
        if doc == (inspect.getdoc(BaseModel) or ""):
            doc = ""
        return cls(tool_name, description if description is not None else _oneline(doc),
                   model_cls, fn)

    @classmethod
    def from_openai(cls, spec: object, where: str = "tool") -> Tool:
        """A tool from OpenAI's JSON form, `{"type": "function", "function": {"name",
        "description", "parameters"}}` (chat completions) or the same keys without the
        `function` level (Responses). It has no function to run: a client's program runs
        its own tools. ValueError, naming `where`, for anything else."""
        body = spec.get("function", spec) if isinstance(spec, dict) else None
        if not isinstance(body, dict) or (isinstance(spec, dict) and
                                          spec.get("type", "function") != "function"):
            raise ValueError(f"{where} must be a function tool, {{'type': 'function', "
                             f"'function': {{'name', 'description', 'parameters'}}}}")
        name, description = body.get("name"), body.get("description") or ""
        parameters = body.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(name, str) or not isinstance(description, str) \
                or not isinstance(parameters, dict):
            raise ValueError(f"{where}: name and description must be strings and parameters "
                             "a JSON schema object")
        args_model = pydantic.create_model(  # type: ignore[call-overload]
            _camel(name) + "Args", __config__=ConfigDict(extra="allow"))
        return cls(name, description, args_model, None, parameters)

    def schema(self) -> JSONObject:
        """{"name", "description", "parameters"}: parameters is the arguments' JSON schema."""
        if self.parameters is not None:
            return {"name": self.name, "description": self.description,
                    "parameters": self.parameters}
        parameters = _drop_titles(self.args_model.model_json_schema())
        if parameters.get("description") == self.description:
            del parameters["description"]  # a model docstring already used as the description
        return {"name": self.name, "description": self.description, "parameters": parameters}

    def call(self, arguments: JSONObject) -> str:
        """Run the tool; bad arguments or an exception in it come back as "Error: ..." text."""
        return self.call_with_status(arguments)[0]

    def call_with_status(self, arguments: JSONObject) -> tuple[str, bool]:
        """Run the tool and return (result text, ok). Never raises."""
        if self.fn is None:
            return f"Error: tool {self.name!r} has no function to run", False
        try:
            parsed = self.args_model.model_validate(arguments)
        except pydantic.ValidationError as e:
            return f"Error: invalid arguments for {self.name!r}: {validation_summary(e)}", False
        kwargs = {field: getattr(parsed, field) for field in type(parsed).model_fields}
        try:
            result = self.fn(**kwargs)
        except Exception as e:
            return f"Error: {self.name!r} failed: {type(e).__name__}: {e}", False
        return _result_text(result), True


@overload
def tool(fn: Callable[..., Any]) -> Tool: ...
@overload
def tool(
    fn: None = None, *, name: str | None = None, description: str | None = None
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: `@tool` or `@tool(name=..., description=...)` turns a function into a Tool."""
    if fn is not None:
        return Tool.from_function(fn, name=name, description=description)
    return lambda f: Tool.from_function(f, name=name, description=description)


ToolLike = Tool | Callable[..., Any] | type[BaseModel]
"""What a `tools=` argument takes: a Tool, a typed function or a pydantic model class."""

_EXPECTED = "expected a prefixgym Tool, a typed function or a pydantic model class"


def as_tool(obj: ToolLike, where: str = "tool") -> Tool:
    """`obj` as a Tool: a Tool as it is, a pydantic model class as `Tool.from_model`
    makes it, a function as `@tool` does. ValueError (naming `where`) for anything else."""
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, type) and not issubclass(obj, BaseModel) or not callable(obj):
        what = f"the class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__
        raise ValueError(f"{where} is {what}, {_EXPECTED}")
    try:
        if isinstance(obj, type):
            return Tool.from_model(obj)
        return Tool.from_function(obj)
    except (ValueError, TypeError) as e:  # a signature inspect cannot read is a TypeError
        raise ValueError(f"{where}: {e}") from None


def as_tools(tools: Iterable[ToolLike] | None, where: str = "tools") -> list[Tool]:
    """Each of `tools` as a Tool (see `as_tool`); errors name the position: 'tools[1] ...'."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Tool, type)) or callable(tools):
        raise ValueError(f"{where} must be a list of tools, got {type(tools).__name__}")
    return [as_tool(t, f"{where}[{i}]") for i, t in enumerate(tools)]


def tools_json(tools: Iterable[ToolLike]) -> str:
    """The tool schemas as one JSON array, byte-identical across runs and processes.

    Keys are sorted, separators compact, and tools keep the order given."""
    specs = as_tools(tools)
    names = [t.name for t in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate tool names: {duplicates}")
    return json.dumps([t.schema() for t in specs], sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {argument: description}) from a Google-style docstring."""
    description_lines: list[str] = []
    arg_docs: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    arg_indent: int | None = None
    for line in doc.splitlines():
        stripped = line.strip()
        header = _SECTION_RE.match(line)
        if header:
            section, current, arg_indent = header.group(1), None, None
            continue
        if section is None:
            description_lines.append(stripped)
            continue
        if section not in ("Args", "Arguments", "Parameters") or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if arg_indent is None:
            arg_indent = indent
        match = _ARG_LINE_RE.match(stripped)
        if indent <= arg_indent and match:
            current = match.group(1)
            arg_docs[current] = match.group(2).strip()
        elif current is not None:
            arg_docs[current] = (arg_docs[current] + " " + stripped).strip()
    return _oneline("\n".join(description_lines)), arg_docs


def _oneline(text: str) -> str:
    return " ".join(text.split())


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_\-]", name) if part)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def _drop_titles(schema: Any) -> Any:  # any JSON value in pydantic's schema (dict[str, Any])
    """pydantic's "title" keywords only repeat names; dropping them shortens every prompt."""
    if isinstance(schema, dict):
        out: JSONObject = {}
        for key, value in schema.items():
            if key in ("properties", "$defs") and isinstance(value, dict):
                out[key] = {name: _drop_titles(sub) for name, sub in value.items()}
            elif not (key == "title" and isinstance(value, str)):
                out[key] = _drop_titles(value)
        return out
    if isinstance(schema, list):
        return [_drop_titles(v) for v in schema]
    return schema


def validation_summary(error: pydantic.ValidationError) -> str:
    """Up to five of pydantic's errors as one line, `field: message; ...` (a tool's
    result text and a `ToolCallError`'s message both say them so)."""
    parts = []
    for err in error.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "arguments"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def _result_text(result: object) -> str:
    if isinstance(result, str):
        return result
    if result is None:
        return ""
    if isinstance(result, BaseModel):
        return result.model_dump_json()
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)
