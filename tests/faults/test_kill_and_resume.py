"""SIGKILL a small `prefixgym train` at random points (three seeds) and in the middle
of a checkpoint write: what it leaves is consistent (every checkpoint that claims to
be whole verifies, the metrics parse), and `--resume` finishes the run with every
metrics line once and no leftover temporaries. Each run is a real process, killed
with SIGKILL; every wait is bounded."""

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
from faultkit import TINY, TINY_LINES, assert_complete

from prefixgym.cli import main
from prefixgym.trainer.checkpoint import verify_checkpoint
from prefixgym.trainer.report import MetricsLog

DEADLINE_S = 300


def start(out: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, "-m", "prefixgym", "train", "--out", str(out),
                             *TINY], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def kill_when(proc: subprocess.Popen[bytes], ready: Callable[[], bool]) -> None:
    """SIGKILL `proc` as soon as `ready()` holds (polled; at most DEADLINE_S)."""
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        assert proc.poll() is None, "the run ended before the point to kill it at"
        assert time.monotonic() < deadline, "the run never reached the point to kill it at"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL


def complete_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def assert_consistent_after_kill(out: Path) -> None:
    """What a killed run leaves: checkpoints that are in place verify, the log parses."""
    root = out / "checkpoints"
    for path in root.iterdir() if root.exists() else []:
        if path.is_dir() and not path.name.startswith("."):
            verify_checkpoint(path)  # a whole directory or none, never a half-written one
    MetricsLog(out / "metrics.jsonl").read()  # a partial last line at most


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sigkill_at_a_random_point_then_resume(tmp_path: Path, seed: int) -> None:
    out = tmp_path / "run"
    kill_at = random.Random(seed).randint(1, TINY_LINES - 1)  # metrics lines written
    proc = start(out)
    kill_when(proc, lambda: complete_lines(out) >= kill_at)
    assert_consistent_after_kill(out)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert_complete(out)


def test_sigkill_after_the_warm_start_resumes_from_it(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    warm = out / "checkpoints" / "warm_start"
    proc = start(out)
    kill_when(proc, lambda: (warm / "checkpoint.json").exists())
    assert_consistent_after_kill(out)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert f"resuming from {warm} at GRPO step 0" in capsys.readouterr().err
    assert_complete(out)


def test_sigkill_in_the_middle_of_a_checkpoint_write(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    root = out / "checkpoints"

    def writing_a_step_checkpoint() -> bool:
        return root.exists() and any(p.name.startswith(".step-") for p in root.iterdir())

    proc = start(out)
    kill_when(proc, writing_a_step_checkpoint)
    assert any(p.name.endswith(".tmp") for p in root.iterdir())  # the killed write's leftover
    assert_consistent_after_kill(out)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "leftover temporaries" in capsys.readouterr().err
    assert_complete(out)
