"""Hugging Face chat templates: render them safely, and probe whether appending holds.

`jinja_render.py` renders a template as transformers does, at a fixed clock;
`render.py` runs that within limits in a worker process (`render_worker.py`);
`switches.py` reads a template's reasoning markers and thinking switches; `probes.py`
builds the probe conversations, `prober.py` renders each and checks it, `classify.py`
names a break's rule, and `append_only.py` gives the verdict: is each prompt an
extension of the last prompt plus the reply? The chat format (`hf_template.py`) needs
that verdict to accept a template, and the linter (`lint/`) reports it; this package
imports neither.
"""

from prefixgym.prompting.templates.append_only import TemplateReport, probe_template
from prefixgym.prompting.templates.render import RenderLimits, TemplateRenderer

__all__ = ["RenderLimits", "TemplateRenderer", "TemplateReport", "probe_template"]
