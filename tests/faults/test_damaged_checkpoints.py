"""`--resume` over damaged and foreign checkpoints of a real run: a bit-flipped or
truncated file, an empty loop.json or manifest, a `latest` naming nothing are passed
over (with the reason) for the newest intact checkpoint; another run's checkpoint is
refused in one line, changing nothing, unless --force-resume."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from faultkit import assert_complete, fingerprint, metrics

from prefixgym.cli import main


def train_file(checkpoint: Path, kind: str) -> Path:
    return next((checkpoint / "train").glob(f"{kind}-*"))


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x04
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty(path: Path) -> None:
    path.write_text("")


DAMAGE = {
    "bit-flipped weights": (lambda c: flip(train_file(c, "weights")), "weights-"),
    "truncated weights": (lambda c: truncate(train_file(c, "weights")), "weights-"),
    "truncated state": (lambda c: truncate(train_file(c, "state")), "state-"),
    "bit-flipped state": (lambda c: flip(train_file(c, "state")), "state-"),
    "empty loop.json": (lambda c: empty(c / "loop.json"), "loop.json"),
    "empty train manifest": (lambda c: empty(c / "train" / "manifest.json"), "manifest.json"),
    "empty checkpoint.json": (lambda c: empty(c / "checkpoint.json"), "checkpoint.json"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_latest_is_passed_over_for_the_newest_intact_checkpoint(
    run_copy: Callable[[], Path], damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_copy()
    apply, named = DAMAGE[damage]
    apply(out / "checkpoints" / "step-000003")
    # --steps 2: the run is over once resumed at step 2, so the test stays short
    assert main(["train", "--out", str(out), "--resume", "--no-progress", "--steps", "2"]) == 0
    err = capsys.readouterr().err
    [reason] = [line for line in err.splitlines() if line.startswith("passed over:")]
    assert "step-000003" in reason and named in reason
    assert "resuming from" in err and "step-000001 at GRPO step 2" in err
    lines = metrics(out)  # what the run logged after step-000001 was saved is gone
    assert [r["step"] for r in lines if r["phase"] == "grpo"] == [0, 1]
    assert [r["when"] for r in lines if r["phase"] == "eval"] == ["after warm start", "GRPO"]
    assert (out / "checkpoints" / "latest").read_text() == "step-000001"


def test_a_latest_naming_a_missing_checkpoint_falls_back(
    run_copy: Callable[[], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_copy()
    (out / "checkpoints" / "latest").write_text("step-000099")
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "does not name a checkpoint directory ('step-000099')" in err
    assert "resuming from" in err and "step-000003 at GRPO step 4" in err
    assert_complete(out)


def test_with_nothing_intact_the_run_starts_over_and_keeps_the_old_metrics(
    run_copy: Callable[[], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_copy()
    before = (out / "metrics.jsonl").read_text()
    for checkpoint in ("warm_start", "step-000001", "step-000003"):
        truncate(train_file(out / "checkpoints" / checkpoint, "state"))
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count("passed over:") == 3 and "starting a new run" in err
    assert (out / "metrics.1.jsonl").read_text() == before  # kept, not deleted
    assert_complete(out)


def test_another_runs_checkpoints_are_refused_and_nothing_changes(
    run_copy: Callable[[], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # Run B (seed 1) started in run A's --out, wrote its config and was killed during
    # its warm start: every checkpoint there is A's.
    out = run_copy()
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "seed": 1, "lr": 0.001}))
    (out / "metrics.jsonl").rename(out / "metrics.1.jsonl")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "phase": "eval",
                                                   "when": "before training"}) + "\n")
    before = fingerprint(out)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prefixgym train: ")
    assert (f"step-000003 belongs to another run (lr: 0.001 here, {config['lr']} there; "
            "seed: 1 here, 0 there)") in err[0] and "--force-resume" in err[0]
    assert fingerprint(out) == before


def test_force_resume_loads_another_runs_checkpoint(
    run_copy: Callable[[], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_copy()
    assert main(["train", "--out", str(out), "--resume", "--seed", "1", "--no-progress",
                 "--force-resume", "--steps", "5"]) == 0
    err = capsys.readouterr().err
    assert "belongs to another run (seed: 1 here, 0 there); loaded anyway" in err
    assert [r["step"] for r in metrics(out) if r["phase"] == "grpo"] == [0, 1, 2, 3, 4]


def test_a_resume_may_extend_the_run(run_copy: Callable[[], Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = run_copy()
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--eval-every", "3",
                 "--checkpoint-every", "1", "--no-progress"]) == 0
    assert "step-000003 at GRPO step 4" in capsys.readouterr().err
    assert [r["step"] for r in metrics(out) if r["phase"] == "grpo"] == [0, 1, 2, 3, 4, 5]
    assert (out / "checkpoints" / "latest").read_text() == "step-000005"


def test_a_partial_last_metrics_line_is_dropped_on_resume(
    run_copy: Callable[[], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_copy()
    complete = (out / "metrics.jsonl").read_text()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "phase": "grp')  # a kill in the middle of a write
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert (out / "metrics.jsonl").read_text() == complete
