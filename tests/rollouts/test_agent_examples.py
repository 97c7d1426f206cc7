"""Each agent program in examples/agents/ trains from the command line, with a tiny budget:
`prefixgym train --agent examples/agents/NAME.py:agent --tasks examples/agents/arithmetic.jsonl`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from prefixgym.cli import main  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"


@pytest.mark.parametrize("name", ["plain", "calculator_tools", "arithmetic", "agents_sdk"])
def test_the_example_trains_from_the_command_line(tmp_path, name):
    if name == "agents_sdk":
        pytest.importorskip("agents")
    out = tmp_path / "run"
    argv = ["train", "--agent", f"{EXAMPLES / name}.py:agent",
            "--tasks", str(EXAMPLES / "arithmetic.jsonl"), "--steps", "1",
            "--groups-per-step", "2", "--group-size", "2", "--eval-episodes", "2",
            "--max-tokens", "8", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in records if r["phase"] == "grpo"]
    assert step["episodes/failed"] == 0, step.get("episodes/first_error")
    assert step["tokens/sampled"] > 0 and step["turns/mean"] >= 1
    assert [r["eval/episodes"] for r in records if r["phase"] == "eval"] == [2.0]
