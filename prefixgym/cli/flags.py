"""Command-line flags from a config dataclass: one flag per field, its docstring as help.

A field `group_size: int = 8` with a string literal under it becomes `--group-size N`
with that string as its help text; `bool` fields become on/off switches; `flag_names`
renames a flag (`async_mode` -> `--async`); dict fields take JSON. A config is built
from layers, later ones winning: the dataclass defaults, then whatever the command
adds (a run's saved config, a `--config FILE.toml`), then the flags given on the
command line. Validation stays in the dataclass's `__post_init__`; a `ValueError`
there, like a bad flag or a bad file, becomes one usage line and exit code 2.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar, get_type_hints

from prefixgym.types import JSONObject

C = TypeVar("C")


def field_docs(cls: type) -> dict[str, str]:
    """The string literal placed right under each field of a dataclass."""
    return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """(Parsed once per class: CPython 3.11's AST constructor is not thread-safe, and
    a command run in a thread beside a server that parses too can fail with
    "AST constructor recursion depth mismatch".)"""
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


def json_object(text: str) -> JSONObject:
    """An argparse type: a JSON object given as a flag's value."""
    value = _json(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"k\": 1}}', got {text!r}")
    return value


def json_objects(text: str) -> list[JSONObject]:
    """An argparse type: a JSON list of objects given as a flag's value."""
    value = _json(text)
    if not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of objects like '[{{\"k\": 1}}]', got {text!r}")
    return value


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None


def build_parser(
    cls: type, prog: str, description: str, flag_names: dict[str, str] | None = None,
    config_file: bool = False,
) -> argparse.ArgumentParser:
    """Flags for every field of `cls`; a parsed namespace holds only the flags given.
    `config_file` adds `--config FILE.toml`."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     argument_default=argparse.SUPPRESS)
    if config_file:
        parser.add_argument("--config", metavar="FILE.toml",
                            help="settings from a TOML file (one key per flag, e.g. "
                            "group_size = 8); flags given here win over it")
    docs = field_docs(cls)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + (flag_names or {}).get(f.name, f.name.replace("_", "-"))
        kind = _value_kind(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc,operator]
        help_text = f"{docs.get(f.name, '')} (default: {default!r})".replace("%", "%%")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                help=help_text)
        elif kind in (int, float, str):
            parser.add_argument(flag, dest=f.name, type=kind, help=help_text)
        elif kind == list[str]:  # repeat the flag for several values
            parser.add_argument(flag, dest=f.name, action="append", help=help_text + " (repeat)")
        elif kind == list[JSONObject]:
            parser.add_argument(flag, dest=f.name, type=json_objects,
                                help=help_text + " (JSON list)")
        else:  # dicts come as JSON
            parser.add_argument(flag, dest=f.name, type=json_object, help=help_text + " (JSON)")
    return parser


def read_config_file(cls: type, path: str, flag_names: dict[str, str] | None = None) -> JSONObject:
    """The settings of a TOML file, as field values of `cls`; ValueError names the file."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    by_flag = {v.replace("-", "_"): k for k, v in (flag_names or {}).items()}
    hints = get_type_hints(cls)
    values: JSONObject = {}
    for key, value in table.items():
        name = by_flag.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in hints:
            raise ValueError(f"{path}: unknown setting {key!r}; the settings are the flags "
                             "(see --help), with _ or -")
        values[name] = _typed(path, key, value, hints[name])
    return values


def _value_kind(kind: object) -> object:
    """The type a flag or TOML value takes: `float | None` fields take floats and
    `bool | None` fields booleans (unset, None, is resolved by the config itself)."""
    return {float | None: float, bool | None: bool}.get(kind, kind)  # type: ignore[call-overload]


def _typed(path: str, key: str, value: object, kind: object) -> object:
    kind = _value_kind(kind)
    if kind == list[str]:  # one string stands for a list of one
        if isinstance(value, str):
            return [value]
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{path}: {key} = {value!r} must be a string or a list of strings")
        return value
    if kind == list[JSONObject]:
        if not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            raise ValueError(f"{path}: {key} = {value!r} must be a list of tables")
        return value
    ok = {bool: isinstance(value, bool), str: isinstance(value, str),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool)}.get(
        kind, isinstance(value, dict))  # type: ignore[call-overload]
    if not ok:
        raise ValueError(f"{path}: {key} = {value!r} has the wrong type")
    return float(value) if kind is float else value  # type: ignore[arg-type]


def build_config(
    cls: type[C], parser: argparse.ArgumentParser, *layers: Mapping[str, object]
) -> C:
    """`cls` from its defaults overlaid with `layers` (later ones win); a ValueError
    (from a layer or from validation) becomes a usage error."""
    merged: JSONObject = {}
    for layer in layers:
        merged.update({k: v for k, v in layer.items() if k != "config"})
    try:
        return cls(**merged)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def parse_config(
    cls: type[C], argv: list[str], prog: str, description: str,
    flag_names: dict[str, str] | None = None,
) -> C:
    """`cls` from its defaults and the flags in `argv`."""
    parser = build_parser(cls, prog, description, flag_names)
    return build_config(cls, parser, vars(parser.parse_args(argv)))


def read_json_object(path: Path) -> JSONObject:
    """A JSON object from a file; ValueError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value
