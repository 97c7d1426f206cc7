"""What the fault suite's tests share: a tiny `prefixgym train` budget, what a finished
tiny run looks like, and a fingerprint of every file under a directory ("no state
changed" is: the same fingerprint before and after)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from numerics import from_environment

# 10 metrics lines: eval, 2 sft, eval, 4 grpo, 2 evals; checkpoints warm_start,
# step-000001, step-000003. In the test dtype: runs in this process and runs started
# as processes are compared, and in a process `auto` would be this CPU's choice.
TINY = ["--steps", "4", "--checkpoint-every", "2", "--eval-every", "2", "--sft-steps", "2",
        "--sft-episodes-per-step", "2", "--groups-per-step", "1", "--group-size", "2",
        "--eval-episodes", "2", "--max-tokens", "4", "--no-progress",
        "--compute-dtype", from_environment().name]
TINY_LINES = 10


def fingerprint(root: Path) -> dict[str, str]:
    """Every file under `root` by relative path, with a hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_complete(out: Path) -> None:
    """A finished tiny run: every line once, in order, and its last checkpoint."""
    lines = metrics(out)
    assert [r["step"] for r in lines if r["phase"] == "grpo"] == [0, 1, 2, 3]
    assert [r["sft_step"] for r in lines if r["phase"] == "sft"] == [0, 1]
    assert [(r["when"], r["step"]) for r in lines if r["phase"] == "eval"] == [
        ("after warm start", 0), ("GRPO", 2), ("GRPO", 4)]
    assert (out / "checkpoints" / "latest").read_text() == "step-000003"
    assert (out / "report.md").exists()
    leftovers = [p.name for p in [*out.iterdir(), *(out / "checkpoints").iterdir()]
                 if p.name.endswith(".tmp")]
    assert leftovers == []
