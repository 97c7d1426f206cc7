"""Hugging Face chat templates: render them safely, and probe whether appending holds.

`jinja_render.py` renders a template as transformers does, at a fixed clock;
`render.py` runs that within limits in a worker process (`render_worker.py`);
`switches.py` reads a template's reasoning markers and thinking switches, `content.py`
the shape of message content it prints; `probes.py` builds the probe conversations,
`prober.py` renders each and checks it, `classify.py` names a break's rule, and
`append_only.py` gives the verdict: is each prompt an extension of the last prompt plus
the reply? `fix.py` writes an append-only variant of a template that is not. The chat format (`hf_template.py`) needs
that verdict to accept a template, and the linter (`lint/`) reports it; this package
imports neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixgym.prompting.templates.append_only import TemplateReport, probe_template
    from prefixgym.prompting.templates.render import RenderLimits, TemplateRenderer

_LAZY = {"TemplateReport": "append_only", "probe_template": "append_only",
         "RenderLimits": "render", "TemplateRenderer": "render"}
__all__ = ["RenderLimits", "TemplateRenderer", "TemplateReport", "probe_template"]


def __getattr__(name: str) -> Any:
    # Lazy, so that the render worker, started as `python -m` one of this package's
    # modules, is not imported by the package before it runs as __main__.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixgym.prompting.templates' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"prefixgym.prompting.templates.{module}"), name)
