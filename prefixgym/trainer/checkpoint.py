"""Resumable run state: the training client's state plus the loop's own, saved atomically.

Layout under OUT/checkpoints/:
  step-000009/train/     the training client's save_state (weights, optimizer, RNG)
  step-000009/loop.json  next step, evaluations so far, cumulative usage
  warm_start/train/      the weights after the warm start (the KL reference)
  latest                 the name of the newest complete checkpoint

Each checkpoint is written into a temporary directory and renamed into place, and
`latest` is replaced atomically after it, so a crash leaves the previous one intact.
Knows the training client's save/load protocol and JSON; nothing of models.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixgym.types import Usage


@dataclass
class LoopState:
    next_step: int
    evals: list[dict[str, Any]] = field(default_factory=list)
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


def _write_dir_atomically(target: Path, fill: Any) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def save_checkpoint(out: Path, training: Any, state: LoopState, name: str | None = None) -> Path:
    root = out / "checkpoints"
    name = name or f"step-{state.next_step - 1:06d}"

    def fill(tmp: Path) -> None:
        training.save_state(tmp / "train")
        (tmp / "loop.json").write_text(state.to_json())

    _write_dir_atomically(root / name, fill)
    if name.startswith("step-"):
        pointer = root / "latest.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / "latest")
    return root / name


def latest_checkpoint(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = out / "checkpoints" / pointer.read_text().strip()
    return path if (path / "loop.json").exists() else None


def load_checkpoint(path: Path, training: Any) -> LoopState:
    training.load_state(path / "train")
    return LoopState.from_json((path / "loop.json").read_text())
