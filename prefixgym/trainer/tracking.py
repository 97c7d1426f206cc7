"""Experiment tracking: every metrics.jsonl line also goes to TensorBoard or trackio.

`open_tracker("tensorboard", out)` writes TensorBoard event files under OUT/tensorboard
(through torch's `SummaryWriter`, which needs the optional `tensorboard` package:
`pip install 'prefixgym[tracking]'`); `open_tracker("trackio", out)` logs to trackio's
local store (`pip install 'prefixgym[trackio]'`; local only: no Space, no server).
Each numeric field of a line becomes a scalar, tagged `<phase>/<field>`
(`grpo/reward/mean`, `eval/eval/success`, `sft/sft/loss`), at the line's step (the
warm start's lines at their `sft_step`). metrics.jsonl, report.md and the plots stay
as they are: the tracker is a second copy, and stays one when a run resumes or starts
over: `rewind(step, kept)` leaves the tracker holding the lines `kept` (what
metrics.jsonl keeps; those at steps < `step` are already there). TensorBoard: a new
writer with `purge_step=step` (readers drop the points an earlier process logged at
steps >= `step`), then `kept`'s lines at such steps are logged again (an evaluation on
the checkpoint's weights, warm-start lines, whose steps count from 0 again). trackio,
which cannot forget single points: the run is deleted and `kept` logged anew.

Knows metric dicts; not how they were produced.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from prefixgym.types import JSONObject

TRACKERS = ("", "tensorboard", "trackio")
TRACKIO_PROJECT = "prefixgym"
REMOTE_TRACKIO_VARIABLES = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")


class Tracker(Protocol):
    def log(self, record: JSONObject) -> None: ...

    def rewind(self, step: int, kept: Sequence[JSONObject]) -> None:
        """Hold exactly `kept` from now on (see the module docstring)."""

    def close(self) -> None: ...


def tracker_step(record: JSONObject) -> int:
    """The step a line is logged at: its `step`, a warm-start line's `sft_step`."""
    phase = record.get("phase")
    return int(record.get("sft_step", 0) if phase == "sft" else record.get("step", 0))


def scalars(record: JSONObject) -> dict[str, float]:
    """A line's numbers, tagged `<phase>/<field>` (not its step fields, not booleans)."""
    phase = str(record.get("phase", "metrics"))
    return {f"{phase}/{key}": float(value) for key, value in record.items()
            if key not in ("step", "sft_step") and not isinstance(value, bool)
            and isinstance(value, (int, float))}


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
        step = tracker_step(record)
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, step)
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


class TrackioTracker:
    """One trackio run per OUT, in project "prefixgym" of trackio's local store
    (TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show` views it). The
    run is named after OUT (its name and a hash of its absolute path), so a resumed
    run finds its own; an older run of that name is replaced when this one opens."""

    def __init__(self, out: Path) -> None:
        remote = [name for name in REMOTE_TRACKIO_VARIABLES if os.environ.get(name)]
        if remote:
            raise ValueError(f"--tracker trackio logs locally only: unset {', '.join(remote)}")
        try:
            import trackio
        except ImportError as e:
            raise ValueError("--tracker trackio needs the trackio package: "
                             "pip install 'prefixgym[trackio]' (or pip install trackio)") from e
        self._trackio = trackio
        where = str(Path(out).resolve())
        self.name = f"{Path(where).name}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"
        self._run: Any = None  # opened by the first log or rewind

    def log(self, record: JSONObject) -> None:
        if self._run is None:
            self._open()
        values = scalars(record)
        if values:
            self._run.log(values, step=tracker_step(record))

    def rewind(self, step: int, kept: Sequence[JSONObject]) -> None:
        self.close()
        self._open()
        for record in kept:
            self.log(record)

    def close(self) -> None:
        if self._run is not None:
            with contextlib.redirect_stdout(sys.stderr):  # trackio prints; stdout is ours
                try:  # the run this thread's init made current (else trackio's exit finishes it again)
                    self._trackio.finish()
                except RuntimeError:  # closed from another thread: none is current there
                    self._run.finish()
            self._run = None

    def _open(self) -> None:
        """A fresh run of this name: an older one (another process of this OUT) goes."""
        trackio = self._trackio
        try:
            for run in trackio.Api().runs(TRACKIO_PROJECT):
                if run.name == self.name:
                    run.delete()
        except ValueError:  # the project does not exist yet
            pass
        with contextlib.redirect_stdout(sys.stderr):
            self._run = trackio.init(project=TRACKIO_PROJECT, name=self.name, embed=False,
                                     auto_log_cpu=False, auto_log_gpu=False)


def open_tracker(kind: str, out: Path) -> Tracker | None:
    """The tracker `kind` names (one of TRACKERS; "" is none), writing under `out`."""
    if kind not in TRACKERS:
        raise ValueError(f"--tracker must be tensorboard, trackio or empty, got {kind!r}")
    if kind == "tensorboard":
        return TensorBoardTracker(out / "tensorboard")
    if kind == "trackio":
        return TrackioTracker(out)
    return None
