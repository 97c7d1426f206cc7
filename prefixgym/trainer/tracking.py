"""Experiment tracking: every metrics.jsonl line also goes to TensorBoard, when asked.

`open_tracker("tensorboard", out)` writes TensorBoard event files under OUT/tensorboard
(through torch's `SummaryWriter`, which needs the optional `tensorboard` package:
`pip install 'prefixgym[tracking]'`). Each numeric field of a line becomes a scalar,
tagged `<phase>/<field>` (`grpo/reward/mean`, `eval/eval/success`, `sft/sft/loss`),
at the line's step (the warm start's lines at their `sft_step`). metrics.jsonl,
report.md and the plots stay as they are: the tracker is a second copy.

Knows metric dicts; not how they were produced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from prefixgym.types import JSONObject

TRACKERS = ("", "tensorboard")


class Tracker(Protocol):
    def log(self, record: JSONObject) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, logdir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ValueError(
                "--tracker tensorboard needs the tensorboard package: "
                "pip install 'prefixgym[tracking]' (or pip install tensorboard)"
            ) from e
        self._writer = SummaryWriter(str(logdir))

    def log(self, record: JSONObject) -> None:
        phase = str(record.get("phase", "metrics"))
        step = int(record.get("sft_step", 0) if phase == "sft" else record.get("step", 0))
        for key, value in record.items():
            if key in ("step", "sft_step") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                self._writer.add_scalar(f"{phase}/{key}", float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_tracker(kind: str, out: Path) -> Tracker | None:
    """The tracker `kind` names (one of TRACKERS; "" is none), writing under `out`."""
    if kind not in TRACKERS:
        raise ValueError(f"--tracker must be tensorboard or empty, got {kind!r}")
    if kind == "tensorboard":
        return TensorBoardTracker(out / "tensorboard")
    return None
