"""Command-line flags from a config dataclass: one flag per field, its docstring as help.

A field `group_size: int = 8` with a string literal under it becomes `--group-size N`
with that string as its help text; `bool` fields become on/off switches; `flag_names`
renames a flag (`async_mode` -> `--async`). Validation stays in the dataclass's
`__post_init__`; a `ValueError` there becomes a clean usage error.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import textwrap
from typing import TYPE_CHECKING, TypeVar, get_type_hints

from prefixgym.types import JSONObject

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C")


def field_docs(cls: type) -> dict[str, str]:
    """The string literal placed right under each field of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def build_parser(
    cls: type, prog: str, description: str, flag_names: dict[str, str] | None = None
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    docs = field_docs(cls)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + (flag_names or {}).get(f.name, f.name.replace("_", "-"))
        kind = hints[f.name]
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc,operator]
        help_text = f"{docs.get(f.name, '')} (default: {default!r})".replace("%", "%%")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif kind in (int, float, str):
            parser.add_argument(flag, dest=f.name, type=kind, default=default, help=help_text)
        else:  # dicts and other structured fields come as JSON
            parser.add_argument(flag, dest=f.name, type=json.loads, default=default,
                                help=help_text + " (JSON)")
    return parser


def parse_config(
    cls: type[C], argv: list[str], prog: str, description: str,
    flag_names: dict[str, str] | None = None,
) -> C:
    parser = build_parser(cls, prog, description, flag_names)
    namespace = parser.parse_args(argv)
    try:
        return cls(**vars(namespace))
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def as_dict(config: DataclassInstance) -> JSONObject:
    return dataclasses.asdict(config)
