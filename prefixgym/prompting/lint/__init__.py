"""prefixgym.prompting.lint: find what makes prompts miss the prefix cache.

    probe_template(template_str, bos_token, eos_token, tokenizer=None) -> TemplateReport
    analyze_trace(requests, block_size, capacity_tokens, decode=None) -> TraceReport
    lint_env(env_id, episodes=3) -> EnvReport          (prefixgym.prompting.lint.env)

`prefixgym lint template|trace|env` is `cli/lint.py`; the rules are listed in
`prompting.findings.RULES` and explained in docs/lint-rules.md. The template verdict
itself is `prompting.templates`' (the chat format uses it too); this package reports.
"""

from __future__ import annotations

from prefixgym.prompting.findings import RULES, Finding, LintInputError, Rule
from prefixgym.prompting.lint.cache_sim import SimulatedPrefixCache
from prefixgym.prompting.lint.source import TemplateSource, load_template
from prefixgym.prompting.lint.trace import TraceReport, analyze_trace
from prefixgym.prompting.lint.trace_file import TraceRequest, load_trace
from prefixgym.prompting.templates.append_only import TemplateReport, probe_template

__all__ = [
    "RULES",
    "Finding",
    "LintInputError",
    "Rule",
    "SimulatedPrefixCache",
    "TemplateReport",
    "TemplateSource",
    "TraceReport",
    "TraceRequest",
    "analyze_trace",
    "load_template",
    "load_trace",
    "probe_template",
]
