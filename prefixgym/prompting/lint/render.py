"""Render a chat template the way transformers does, at a clock we choose, within limits.

Uses transformers' own `render_jinja_template` (its sandbox, filters and
`strftime_now`), so what the linter checks is what `apply_chat_template` produces.
`strftime_now` reads `datetime.now()` inside transformers; `fixed_clock` pins it so
that two renders of one conversation compare equal, and so that two different
clocks reveal a template that prints the date. `TemplateRenderer.render` renders in
a worker process under a time, memory and output limit (`render_worker.py`), so a
runaway template is a `RenderLimitError`, never a hang; after one, the renderer
refuses to render that template again (each further render would wait out the limit
too). Knows nothing about what a "break" is: it only turns messages into text or
raises `RenderError`.
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

from prefixgym.prompting.lint import render_worker
from prefixgym.prompting.lint.findings import LintInputError
from prefixgym.prompting.lint.render_worker import RenderError, RenderLimitError, RenderLimits
from prefixgym.types import JSONObject

__all__ = ["CLOCK_A", "CLOCK_B", "RenderError", "RenderLimitError", "RenderLimits",
           "TemplateRenderer", "fixed_clock", "render_in_process"]

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


class TemplateRenderer:
    """Renders message lists with one chat template, BOS and EOS strings, each render
    within `limits`.

    `variables` are passed to every render (a tokenizer's other special tokens).
    Raises `LintInputError` at construction when the template does not compile.
    """

    def __init__(self, template: str, bos_token: str | None, eos_token: str | None,
                 origin: str = "<template>", variables: Mapping[str, Any] | None = None,
                 limits: RenderLimits | None = None) -> None:
        self.template = template
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.variables = dict(variables or {})
        self.limits = limits or RenderLimits()
        self.limit_hit: str | None = None
        """The first limit a render of this template hit; no render is tried after it."""
        backend = _transformers_backend()
        try:  # compiling runs nothing of the template, so it needs no limit
            if backend is not None:
                compiled = backend[0]._compile_jinja_template(template)
            else:
                compiled = _fallback_compile(template)
            self.syntax_tree = compiled.environment.parse(template)
        except jinja2.TemplateSyntaxError as exc:
            raise LintInputError(f"{origin}:{exc.lineno}: template does not compile: {exc.message}") from None

    @property
    def reads_date_statically(self) -> bool:
        return bool(DATE_READ_PATTERN.search(self.template))

    def render(self, messages: list[JSONObject], add_generation_prompt: bool,
               tools: list[JSONObject] | None = None, clock: datetime = CLOCK_A,
               variables: Mapping[str, Any] | None = None) -> str:
        """The template's text for `messages`; `variables` (a switch such as
        enable_thinking) are passed beside the constructor's. Raises `RenderError`, or
        `RenderLimitError` once a render of this template exceeded a limit."""
        if self.limit_hit is not None:
            raise RenderLimitError(self.limit_hit)
        kwargs = {**self.variables, **(variables or {}),
                  "bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            return render_worker.render(self.template, messages, add_generation_prompt, tools,
                                        clock, kwargs, self.limits)
        except RenderLimitError as exc:
            self.limit_hit = str(exc)
            raise
