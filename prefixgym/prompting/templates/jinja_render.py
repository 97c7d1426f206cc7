"""Render a chat template in this process, the way transformers does, at a clock we
choose: the render itself, without limits (`render.py` puts limits around it, in a
worker process: `render_worker.py`).

Uses transformers' own `render_jinja_template` (its sandbox, filters and
`strftime_now`), so what is checked is what `apply_chat_template` produces.
`strftime_now` reads `datetime.now()` inside transformers; `fixed_clock` pins it so
that two renders of one conversation compare equal, and so that two different clocks
reveal a template that prints the date. Knows nothing of limits or of what a "break"
is: it turns messages into text or raises `RenderError`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, tzinfo
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefixgym.types import JSONObject

__all__ = ["CLOCK_A", "CLOCK_B", "DATE_READ_PATTERN", "RenderError", "RenderLimitError",
           "fixed_clock", "parse_template", "render_in_process"]


class RenderError(Exception):
    """The template raised while rendering one conversation (e.g. raise_exception)."""


class RenderLimitError(RenderError):
    """A render exceeded its time, memory or output limit (a runaway template)."""


CLOCK_A = datetime(2024, 1, 15, 9, 30, 0)
CLOCK_B = datetime(2025, 7, 4, 18, 5, 42)

# Names through which a template can see the current date.
DATE_READ_PATTERN = re.compile(
    r"strftime_now|\bnow\s*\(|\bdate_string\b|\bcurrent_date\b|\btoday\b|\bdatetime\b"
)


# transformers' chat_template_utils module (Any: its `datetime` global gets patched, which
# ModuleType does not allow) and its render_jinja_template (annotated `-> str`, though it
# returns (texts, indices)).
_Backend = tuple[Any, Callable[..., Any]]


def _transformers_backend() -> _Backend | None:
    try:
        from transformers.utils import chat_template_utils as ctu

        return ctu, ctu.render_jinja_template
    except (ImportError, AttributeError):
        return None


class _Clock:
    now_value: datetime = CLOCK_A


@functools.lru_cache(maxsize=8)
def _fallback_compile(template: str) -> jinja2.Template:
    # Used only when the installed transformers has no render_jinja_template.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: _Clock.now_value.strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
        x, ensure_ascii=False, indent=indent, sort_keys=kw.get("sort_keys", False)
    )
    return env.from_string(template)


@contextlib.contextmanager
def fixed_clock(when: datetime) -> Iterator[None]:
    """Make `strftime_now` inside templates read `when` (not thread-safe; the CLI is single-threaded)."""
    backend = _transformers_backend()
    previous_value = _Clock.now_value
    _Clock.now_value = when
    if backend is None:
        try:
            yield
        finally:
            _Clock.now_value = previous_value
        return
    ctu = backend[0]
    real = ctu.datetime

    class _Frozen(datetime):
        @classmethod
        def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
            return when

    ctu.datetime = _Frozen
    try:
        yield
    finally:
        ctu.datetime = real
        _Clock.now_value = previous_value


def render_in_process(
    template: str, messages: list[JSONObject], add_generation_prompt: bool,
    tools: list[JSONObject] | None, clock: datetime, variables: Mapping[str, Any],
) -> str:
    """One render in this process, without limits (what the render worker runs).
    Raises `RenderError` for anything the template raises but MemoryError."""
    backend = _transformers_backend()
    try:
        with fixed_clock(clock):
            if backend is None:
                return _fallback_compile(template).render(
                    messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                    **variables)
            rendered, _ = backend[1](
                conversations=[messages], tools=tools, chat_template=template,
                add_generation_prompt=add_generation_prompt, **variables,
            )
            return str(rendered[0])
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001  (a template may raise anything; the probe records it)
        raise RenderError(f"{type(exc).__name__}: {exc}") from None


def parse_template(template: str) -> jinja2.nodes.Template:
    """The template's syntax tree, parsed with transformers' environment's settings,
    extensions, filter and test names (so its tags parse and its filters are known);
    raises jinja2.TemplateSyntaxError. Nothing of the template runs, and nothing is
    folded, here or in what reads the tree (jinja2's `meta` walks it with its code
    generator, which computes constant expressions): every operator counts as
    intercepted, as a sandbox's may be, and every filter and test as one that needs the
    render's context, so `'x' * 10**10` and `'x'|center(10000000000)` stay expressions
    for the render worker, under its limits, instead of 10 GB in the caller."""
    return _analysis_environment().parse(template)


class _NothingFolded(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})
    intercepted_unops = frozenset({"+", "-"})


@jinja2.pass_context
def _never_run(context: jinja2.runtime.Context, *args: Any, **kwargs: Any) -> None:
    raise AssertionError("a template parsed for analysis is never rendered")


@functools.lru_cache(maxsize=1)
def _analysis_environment() -> jinja2.Environment:
    backend = _transformers_backend()
    model = (backend[0]._compile_jinja_template("") if backend is not None
             else _fallback_compile("")).environment
    env = _NothingFolded(trim_blocks=model.trim_blocks, lstrip_blocks=model.lstrip_blocks,
                         extensions=[type(e) for e in model.extensions.values()])
    env.filters = dict.fromkeys(model.filters, _never_run)
    env.tests = dict.fromkeys(model.tests, _never_run)
    return env
