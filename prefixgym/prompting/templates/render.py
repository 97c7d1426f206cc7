"""Render a chat template the way transformers does, at a clock we choose, within limits.

The render itself is `jinja_render.py`'s (transformers' own `render_jinja_template`
at a fixed clock). `TemplateRenderer.render` runs it in a worker process under a time,
memory and output limit (`render_worker.py`), so a runaway template is a
`RenderLimitError`, never a hang; after one, the renderer refuses to render that
template again (each further render would wait out the limit too). Knows nothing
about what a "break" is: it only turns messages into text or raises `RenderError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2

from prefixgym.prompting.findings import LintInputError
from prefixgym.prompting.templates import render_worker
from prefixgym.prompting.templates.jinja_render import (
    CLOCK_A,
    CLOCK_B,
    DATE_READ_PATTERN,
    RenderError,
    RenderLimitError,
    fixed_clock,
    parse_template,
    render_in_process,
)
from prefixgym.prompting.templates.render_worker import RenderLimits
from prefixgym.types import JSONObject

__all__ = ["CLOCK_A", "CLOCK_B", "RenderError", "RenderLimitError", "RenderLimits",
           "TemplateRenderer", "fixed_clock", "render_in_process"]

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
        try:  # parsing runs and folds nothing of the template, so it needs no limit
            self.syntax_tree = parse_template(template)
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
