"""`prefixgym lint trace` on hostile files: one line naming file:line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixgym.cli.lint import main as lint_main

GOOD = '{"prompt_tokens": [1, 2, 3]}\n'


@pytest.mark.parametrize(("line", "message"), [
    ("[" * 200_000 + "]" * 200_000, ":2: JSON nested too deeply to read"),
    ('{"prompt_tokens": [1, 2], "usage": {"prefill_cached_tokens": "many"}}',
     ":2: 'usage'.prefill_cached_tokens must be a non-negative integer, got 'many'"),
    ('{"prompt_tokens": [1, 2], "usage": {"prefill_computed_tokens": -5}}',
     ":2: 'usage'.prefill_computed_tokens must be a non-negative integer, got -5"),
    ('{"prompt_tokens": [1, 2], "usage": {"sampled_tokens": 1.5}}', ":2: 'usage'.sampled_tokens"),
    ('{"prompt_tokens": [1' + "0" * 5000 + "]}", ":2: invalid JSON"),
])
def test_a_bad_trace_line_is_one_line_naming_file_and_line(
    tmp_path: Path, line: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(GOOD + line + "\n" + GOOD)
    assert lint_main(["trace", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{trace}{message}" in err and "\n" not in err and len(err) < 400
