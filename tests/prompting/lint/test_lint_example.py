"""The linting example runs, and the report's colour appears only when asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lint_templates as T

from prefixgym.prompting.lint.report import render_text
from prefixgym.prompting.templates.append_only import probe_template

ROOT = Path(__file__).resolve().parents[3]


def test_example_runs_and_reports_pg101_and_pg201(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lint_template_and_trace.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "PG101 error [reasoning-stripped]" in proc.stdout
    assert "PG201 error [retokenized-history]" in proc.stdout
    assert "episode re-encodes-text" in proc.stdout and "episode appends-ids" not in proc.stdout
    assert (tmp_path / "trace.jsonl").is_file()


def test_colour_only_when_asked() -> None:
    report = probe_template(T.STRIPS_THINK, "", "<|im_end|>")
    assert "\033[" not in render_text(report)
    coloured = render_text(report, use_colour=True)
    assert "\033[31m" in coloured and "\033[0m" in coloured
