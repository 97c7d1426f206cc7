"""What a chat template reads besides the messages: reasoning markers and switch variables.

Both are found in the template's source, so that the probes try what this template
can do: a reply with each reasoning block it knows (`<think>…</think>` always, and
`<reasoning>…</reasoning>`, `[THINK]…[/THINK]`, `<|START_THINKING|>…<|END_THINKING|>`
and the like when the source names them), and each switch it reads (`enable_thinking`,
`thinking`, `reasoning_effort`, any other variable) set each way. Knows nothing of
rendering or of what a break is; it reads the source and its Jinja syntax tree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jinja2.meta
from jinja2 import nodes

SwitchValue = str | int | float | bool



@dataclass(frozen=True)
class Marker:
    """The two tags around a reasoning block, e.g. `<think>` and `</think>`."""

    opener: str
    closer: str


THINK = Marker("<think>", "</think>")

# A tag whose name says "reasoning": think, thinking, reasoning, thought, seed:think, ...
_REASONING_NAME = r"[\w:.-]*(?:think|reason|thought)[\w:.-]*"
_MARKER_PATTERNS = [
    # <think> ... </think>
    (re.compile(rf"</({_REASONING_NAME})>", re.IGNORECASE), "<{}>", "</{}>"),
    # [THINK] ... [/THINK]
    (re.compile(rf"\[/({_REASONING_NAME})\]", re.IGNORECASE), "[{}]", "[/{}]"),
    # <|START_THINKING|> ... <|END_THINKING|>
    (re.compile(rf"<\|END_((?i:{_REASONING_NAME}))\|>"), "<|START_{}|>", "<|END_{}|>"),
    # <|begin_of_thought|> ... <|end_of_thought|>
    (re.compile(rf"<\|end_of_({_REASONING_NAME})\|>", re.IGNORECASE), "<|begin_of_{}|>", "<|end_of_{}|>"),
]

# Variables every chat template may read that are not switches: the conversation, the
# special tokens, the date (PG108 covers it) and the functions transformers provides.
NOT_SWITCHES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens", "raise_exception", "strftime_now", "namespace", "range", "dict",
    "lipsum", "cycler", "joiner", "date_string", "current_date", "today", "now",
})
# Tried first: the switches that turn reasoning on and off in well-known templates.
THINKING_SWITCHES = ("enable_thinking", "thinking", "reasoning_effort")
EFFORT_LEVELS = ("low", "medium", "high")
MAX_SWITCHES = 8


@dataclass(frozen=True)
class Setting:
    """Extra variables a template is rendered with: none (its defaults), or one switch set."""

    variables: tuple[tuple[str, SwitchValue], ...] = ()

    @property
    def label(self) -> str:
        """'' for the defaults, else 'enable_thinking=True'."""
        return ", ".join(f"{name}={value!r}" for name, value in self.variables)

    def kwargs(self) -> dict[str, SwitchValue]:
        return dict(self.variables)


DEFAULT = Setting()


def reasoning_markers(template: str) -> list[Marker]:
    """`<think>`/`</think>`, then every other reasoning block the source closes, in order."""
    found = [THINK]
    for pattern, opener, closer in _MARKER_PATTERNS:
        for match in pattern.finditer(template):
            marker = Marker(opener.format(match.group(1)), closer.format(match.group(1)))
            if marker not in found:
                found.append(marker)
    return found


def _literals(node: nodes.Node) -> list[SwitchValue]:
    """The constants in `x == 'high'` or `x in ['low', 'high']`: a Const or a list of them."""
    if isinstance(node, nodes.Const) and isinstance(node.value, (str, int, float, bool)):
        return [node.value]
    if isinstance(node, nodes.Const) and isinstance(node.value, (list, tuple)):  # folded by Jinja
        return [v for v in node.value if isinstance(v, (str, int, float, bool))]
    if isinstance(node, (nodes.List, nodes.Tuple)):
        return [v for item in node.items for v in _literals(item)]
    return []


def _compared_values(ast: nodes.Template, name: str) -> list[SwitchValue]:
    """Every constant that `name` is compared with in the template, in source order."""
    values: list[SwitchValue] = []
    for compare in ast.find_all(nodes.Compare):
        operands = [compare.expr, *(op.expr for op in compare.ops)]
        if any(isinstance(o, nodes.Name) and o.name == name for o in operands):
            values += [v for o in operands for v in _literals(o)]
    return values


def switch_settings(ast: nodes.Template) -> list[Setting]:
    """One setting per switch and value: each variable the template reads (and does not
    set itself without asking whether it was passed) set to True and False, and to each
    constant the template compares it with (effort levels for a `*_effort` variable).
    The defaults (no variable passed) are not in the list."""
    # a name the template sets itself is a local, unless it asks whether it was passed
    # (`{% if enable_thinking is not defined %}{% set enable_thinking = true %}`)
    assigned = {n.name for n in ast.find_all(nodes.Name) if n.ctx in ("store", "param")}
    asked = {t.node.name for t in ast.find_all(nodes.Test)
             if t.name in ("defined", "undefined") and isinstance(t.node, nodes.Name)}
    read = jinja2.meta.find_undeclared_variables(ast) - NOT_SWITCHES - (assigned - asked)
    names = [n for n in THINKING_SWITCHES if n in read] + sorted(read - set(THINKING_SWITCHES))
    settings: list[Setting] = []
    for name in names[:MAX_SWITCHES]:
        values: list[SwitchValue] = [True, False, *_compared_values(ast, name)]
        if name.endswith("effort"):
            values += list(EFFORT_LEVELS)
        unique: list[SwitchValue] = []
        for value in values:
            if not any(value == u and type(value) is type(u) for u in unique):
                unique.append(value)
        settings += [Setting(((name, value),)) for value in unique]
    return settings
