"""Experiment tracking: every metrics.jsonl line also goes to TensorBoard, when asked.

`open_tracker("tensorboard", out)` writes TensorBoard event files under OUT/tensorboard
(through torch's `SummaryWriter`, which needs the optional `tensorboard` package:
`pip install 'prefixgym[tracking]'`). Each numeric field of a line becomes a scalar,
tagged `<phase>/<field>` (`grpo/reward/mean`, `eval/eval/success`, `sft/sft/loss`),
at the line's step (the warm start's lines at their `sft_step`). metrics.jsonl,
report.md and the plots stay as they are: the tracker is a second copy, and stays one
when a run resumes or starts over: `rewind(step, kept)` hides every point an earlier
process logged at a step >= `step` (TensorBoard's `purge_step`: the writer of the new
process starts with a restart marker at `step`, and readers drop what came before it
at or after that step) and logs again the lines of `kept` at such steps -- the lines
metrics.jsonl keeps there (an evaluation on the checkpoint's weights, warm-start lines,
whose steps count from 0 again).

Knows metric dicts; not how they were produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from prefixgym.types import JSONObject

TRACKERS = ("", "tensorboard")


class Tracker(Protocol):
    def log(self, record: JSONObject) -> None: ...

    def rewind(self, step: int, kept: Sequence[JSONObject]) -> None:
        """Forget what was logged at steps >= `step`; log `kept`'s lines there again."""

    def close(self) -> None: ...


def tracker_step(record: JSONObject) -> int:
    """The step a line is logged at: its `step`, a warm-start line's `sft_step`."""
    phase = record.get("phase")
    return int(record.get("sft_step", 0) if phase == "sft" else record.get("step", 0))


class TensorBoardTracker:
    def __init__(self, logdir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ValueError(
                "--tracker tensorboard needs the tensorboard package: "
                "pip install 'prefixgym[tracking]' (or pip install tensorboard)"
            ) from e
        self._open = SummaryWriter
        self._logdir = str(logdir)
        self._writer: Any = None  # opened by the first log or rewind

    def log(self, record: JSONObject) -> None:
        if self._writer is None:
            self._writer = self._open(self._logdir)
        phase = str(record.get("phase", "metrics"))
        step = tracker_step(record)
        for key, value in record.items():
            if key in ("step", "sft_step") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                self._writer.add_scalar(f"{phase}/{key}", float(value), step)
        self._writer.flush()

    def rewind(self, step: int, kept: Sequence[JSONObject]) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = self._open(self._logdir, purge_step=step)
        for record in kept:
            if tracker_step(record) >= step:
                self.log(record)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def open_tracker(kind: str, out: Path) -> Tracker | None:
    """The tracker `kind` names (one of TRACKERS; "" is none), writing under `out`."""
    if kind not in TRACKERS:
        raise ValueError(f"--tracker must be tensorboard or empty, got {kind!r}")
    if kind == "tensorboard":
        return TensorBoardTracker(out / "tensorboard")
    return None
