"""SIGKILL a small `prefixgym train` at random points (three seeds' points, one per
process: the run, its resume, that resume's resume), after its warm start and in the
middle of a checkpoint write: what it leaves is consistent (every checkpoint that
claims to be whole verifies, the metrics parse and are the start of the finished run's
lines), and `--resume` finishes the run with every metrics line once and no leftover
temporaries. Each run is a real process, killed with SIGKILL; every wait is bounded."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from faultkit import TINY, TINY_LINES, assert_complete, metrics

from prefixgym.cli import main
from prefixgym.trainer.checkpoint import verify_checkpoint
from prefixgym.trainer.report import MetricsLog

DEADLINE_S = 300


def start(out: Path, *args: str, stderr: Path | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with open(stderr or os.devnull, "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "prefixgym", "train", "--out", str(out),
                                 *args], env=env, stdout=subprocess.DEVNULL, stderr=err)


def kill_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool]) -> None:
    """SIGKILL `proc` at a moment `ready()` holds (polled; at most DEADLINE_S). The
    process is stopped first and `ready()` checked again, so a passing state (a write
    in progress) is still there when the kill lands; if it has passed, polling goes on."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert proc.poll() is None, "the run ended before the point to kill it at"
        assert time.monotonic() < deadline, "the run never reached the point to kill it at"
        if ready():
            proc.send_signal(signal.SIGSTOP)
            if ready():
                break
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL


def complete_lines(out: Path) -> int:
    try:  # (a run that starts over moves the log aside first: for a moment there is none)
        return (out / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def assert_consistent_after_kill(out: Path) -> None:
    """What a killed run leaves: checkpoints that are in place verify, the log parses."""
    root = out / "checkpoints"
    for path in root.iterdir() if root.exists() else []:
        if path.is_dir() and not path.name.startswith("."):
            verify_checkpoint(path)  # a whole directory or none, never a half-written one
    MetricsLog(out / "metrics.jsonl").read()  # a partial last line at most


def line_keys(records: list[dict]) -> list[tuple[object, ...]]:
    return [(r["phase"], r.get("when"), r.get("step"), r.get("sft_step")) for r in records]


def test_sigkill_at_random_points_then_resume(tmp_path: Path, finished_run: Path) -> None:
    # Seeds 0-2 each pick a point (metrics lines written); one process is killed at
    # each, in order: the run, then its `--resume`, then that one's `--resume`. A point
    # the last kill already passed moves to the next line, so every kill lands on
    # lines the killed process wrote itself.
    out = tmp_path / "run"
    points = sorted(random.Random(seed).randint(1, TINY_LINES - 1) for seed in (0, 1, 2))
    assert len(set(points)) == 3  # (1, 3, 7): before any checkpoint, in SFT, in GRPO
    finished = line_keys(metrics(finished_run))
    args = TINY
    for point in points:
        kill_at = max(point, complete_lines(out) + 1)
        proc = start(out, *args)
        kill_when(proc, lambda: complete_lines(out) >= kill_at)
        assert_consistent_after_kill(out)
        written = line_keys(MetricsLog(out / "metrics.jsonl").read())
        assert len(written) >= kill_at and written == finished[:len(written)]
        args = ["--resume", "--no-progress"]
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert_complete(out)


def test_sigkill_after_the_warm_start_then_in_a_checkpoint_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Killed once the warm start is saved (before any GRPO checkpoint): the resume
    # starts from it. That resume is killed in the middle of a step checkpoint's write:
    # the half-written directory is a temporary, removed by the next resume.
    out = tmp_path / "run"
    root = out / "checkpoints"
    warm = root / "warm_start"
    kill_when(start(out, *TINY), lambda: (warm / "checkpoint.json").exists())
    assert_consistent_after_kill(out)

    def writing_a_step_checkpoint() -> bool:
        return any(p.name.startswith(".step-") for p in root.iterdir())

    log = tmp_path / "resume.err"
    kill_when(start(out, "--resume", "--no-progress", stderr=log), writing_a_step_checkpoint)
    assert f"resuming from {warm} at GRPO step 0" in log.read_text()
    assert any(p.name.endswith(".tmp") for p in root.iterdir())  # the killed write's leftover
    assert_consistent_after_kill(out)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "leftover temporaries" in capsys.readouterr().err
    assert_complete(out)


def test_sigkill_in_the_middle_of_the_warm_start_then_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # With 4 warm-start steps and a checkpoint every 2, the warm start saves sft-000001;
    # killed after that and before it ends, the resume goes on from its step 2 (not from
    # the start: test_train.py checks that it logs what the uninterrupted run does).
    out = tmp_path / "run"
    root = out / "checkpoints"
    args = [*TINY, "--sft-steps", "4"]

    def in_the_warm_start_after_its_checkpoint() -> bool:
        return (root / "sft-000001" / "checkpoint.json").exists() and not (
            root / "warm_start").exists()

    kill_when(start(out, *args), in_the_warm_start_after_its_checkpoint)
    assert_consistent_after_kill(out)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert f"resuming from {root / 'sft-000001'} at warm-start step 2" in capsys.readouterr().err
    lines = metrics(out)
    assert [r["sft_step"] for r in lines if r["phase"] == "sft"] == [0, 1, 2, 3]
    assert [r["step"] for r in lines if r["phase"] == "grpo"] == [0, 1, 2, 3]
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step-000001", "step-000003", "warm_start"]
