"""Resumable run state: the training client's state plus the loop's own, saved atomically.

Layout under OUT/checkpoints/:
  step-000009/train/     the training client's save_state (weights, optimizer, RNG)
  step-000009/loop.json  next step, evaluations so far, cumulative usage
  step-000009/config.json  the run's full resolved config (when the run gave it)
  warm_start/train/      the weights after the warm start (the KL reference)
  latest                 the name of the newest complete checkpoint

Each checkpoint is written into a temporary directory and renamed into place, and
`latest` is replaced atomically after it (`prefixgym.files`), so a crash leaves the
previous one intact.
Knows the training client's save/load protocol and JSON; nothing of models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from prefixgym.files import write_dir_atomically, write_text_atomically
from prefixgym.protocols import TrainingClient
from prefixgym.types import JSONObject, Usage

WARM_START = "warm_start"


@dataclass
class LoopState:
    next_step: int
    evals: list[JSONObject] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    sft_usage: Usage = field(default_factory=Usage)
    wall_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps({
            "next_step": self.next_step, "evals": self.evals,
            "usage": self.usage.model_dump(), "sft_usage": self.sft_usage.model_dump(),
            "wall_s": self.wall_s,
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LoopState:
        d = json.loads(text)
        return cls(d["next_step"], d["evals"], Usage(**d["usage"]), Usage(**d["sft_usage"]),
                   d["wall_s"])


def save_checkpoint(
    out: Path, training: TrainingClient, state: LoopState, name: str | None = None,
    config: JSONObject | None = None,
) -> Path:
    root = out / "checkpoints"
    name = name or f"step-{state.next_step - 1:06d}"

    def fill(tmp: Path) -> None:
        training.save_state(tmp / "train")
        (tmp / "loop.json").write_text(state.to_json())
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    write_dir_atomically(root / name, fill)
    if name.startswith("step-"):
        write_text_atomically(root / "latest", name)
    return root / name


def latest_checkpoint(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = out / "checkpoints" / pointer.read_text().strip()
    return path if (path / "loop.json").exists() else None


def newest_checkpoint(out: Path) -> Path | None:
    """The latest GRPO checkpoint, else the warm-start one, else None."""
    warm = out / "checkpoints" / WARM_START
    return latest_checkpoint(out) or (warm if (warm / "loop.json").exists() else None)


def load_checkpoint(path: Path, training: TrainingClient) -> LoopState:
    training.load_state(path / "train")
    return LoopState.from_json((path / "loop.json").read_text())
