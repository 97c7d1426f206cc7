"""examples/conversation_cache.py runs, and its later turns hit the prefix cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "conversation_cache.py"


def test_example_runs_and_later_turns_are_served_from_the_cache(capsys):
    spec = importlib.util.spec_from_file_location("conversation_cache", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(turns=2, max_tokens=4)
    assert [r["cached"] + r["computed"] for r in rows] == [r["prompt"] for r in rows]
    assert rows[0]["cached"] == 0
    # turn 2's prompt extends turn 1's prompt + reply: all but the last partial block hit
    assert rows[1]["cached"] >= rows[0]["prompt"] - 16
    assert "served from the prefix cache" in capsys.readouterr().out
