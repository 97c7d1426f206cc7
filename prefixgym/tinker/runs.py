"""Local training runs and their checkpoints, on disk, named by `tinker://` paths.

Every training client a `ServiceClient` makes is a training run, as on the hosted
service: an id (`<uuid>:train:0`), its base model, LoRA rank and `user_metadata`, kept
in `ROOT/<run id>/run.json` under the checkpoint root, so that another process (a
resumed run) finds it. Its checkpoints are directories beside it:
`ROOT/<run id>/weights/<name>` (`save_state`) and `.../sampler_weights/<name>`
(`save_weights_for_sampler`), named to clients as `tinker://<run id>/weights/<name>`.
`resolve` turns such a path (or a plain directory path) into the directory. Knows
tinker's path format and types; nothing of engines.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tinker import types as tt

RUN_FILE = "run.json"
SEGMENTS: dict[str, tt.CheckpointType] = {"weights": "training", "sampler_weights": "sampler"}
"""A checkpoint path's middle part -> its checkpoint type."""
PREFIX = "tinker://"


def parse(path: str) -> tuple[str, str, str]:
    """(run id, segment, name) of `tinker://<run id>/<segment>/<name>`; ValueError (as the
    SDK's `ParsedCheckpointTinkerPath`) for anything else."""
    if not path.startswith(PREFIX):
        raise ValueError(f"Invalid tinker path: {path}")
    parts = path[len(PREFIX):].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENTS or not parts[0] or not parts[2]:
        raise ValueError(f"Invalid tinker path: {path}")
    return parts[0], parts[1], parts[2]


def _now() -> datetime:
    return datetime.now(UTC)


class RunStore:
    """The training runs under one checkpoint root."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def new_run(self, base_model: str, lora_rank: int | None,
                user_metadata: dict[str, str] | None) -> str:
        """A new run's id, its run.json written."""
        run_id = f"{uuid.uuid4()}:train:0"
        directory = self.root / run_id
        directory.mkdir(parents=True)
        record = {"training_run_id": run_id, "base_model": base_model,
                  "is_lora": lora_rank is not None, "lora_rank": lora_rank,
                  "user_metadata": dict(user_metadata or {}), "created": _now().isoformat()}
        (directory / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n")
        return run_id

    def checkpoint_dir(self, run_id: str, segment: str, name: str) -> Path:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"a checkpoint name is one path part, got {name!r}")
        return self.root / run_id / segment / name

    @staticmethod
    def path_of(run_id: str, segment: str, name: str) -> str:
        return f"{PREFIX}{run_id}/{segment}/{name}"

    def resolve(self, path: str | os.PathLike[str]) -> Path:
        """The directory a `tinker://` path (or a plain path) names."""
        text = os.fspath(path)
        if text.startswith(PREFIX):
            run_id, segment, name = parse(text)
            return self.root / run_id / segment / name
        return Path(text)

    # -- what the RestClient reads ----------------------------------------------------

    def _record(self, run_id: str) -> dict[str, Any]:
        path = self.root / run_id / RUN_FILE
        if "/" in run_id or not path.is_file():
            raise LookupError(f"no training run {run_id!r} under {self.root}")
        record: dict[str, Any] = json.loads(path.read_text())
        return record

    def checkpoints(self, run_id: str) -> list[tt.Checkpoint]:
        """The run's checkpoints, oldest first."""
        public = set(self._record(run_id).get("public", []))
        found = []
        for segment, kind in SEGMENTS.items():
            for directory in (self.root / run_id / segment).glob("*"):
                if directory.is_dir():
                    found.append(tt.Checkpoint(
                        checkpoint_id=f"{segment}/{directory.name}", checkpoint_type=kind,
                        time=datetime.fromtimestamp(directory.stat().st_mtime, UTC),
                        tinker_path=self.path_of(run_id, segment, directory.name),
                        size_bytes=sum(f.stat().st_size for f in directory.rglob("*")
                                       if f.is_file()),
                        public=f"{segment}/{directory.name}" in public))
        return sorted(found, key=lambda c: (c.time, c.checkpoint_id))

    def training_run(self, run_id: str) -> tt.TrainingRun:
        record = self._record(run_id)
        checkpoints = self.checkpoints(run_id)
        last = {kind: [c for c in checkpoints if c.checkpoint_type == kind]
                for kind in ("training", "sampler")}
        times = [c.time for c in checkpoints] or [datetime.fromisoformat(record["created"])]
        return tt.TrainingRun(
            training_run_id=run_id, base_model=record["base_model"], model_owner="local",
            is_lora=record["is_lora"], lora_rank=record["lora_rank"],
            last_request_time=max(times),
            last_checkpoint=last["training"][-1] if last["training"] else None,
            last_sampler_checkpoint=last["sampler"][-1] if last["sampler"] else None,
            user_metadata=record["user_metadata"] or None)

    def run_ids(self) -> list[str]:
        """Every run under the root, newest first."""
        runs = [p.parent for p in self.root.glob(f"*/{RUN_FILE}")]
        return [p.name for p in sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True)]

    def delete(self, run_id: str, checkpoint_id: str) -> None:
        segment, _, name = checkpoint_id.partition("/")
        self._record(run_id)
        directory = self.root / run_id / segment / name
        if segment not in SEGMENTS or "/" in name or not directory.is_dir():
            raise LookupError(f"training run {run_id!r} has no checkpoint {checkpoint_id!r}")
        shutil.rmtree(directory)

    def set_public(self, path: str, public: bool) -> None:
        """Mark a checkpoint published (or not): locally, a flag the listing shows."""
        run_id, segment, name = parse(path)
        record = self._record(run_id)
        if not self.resolve(path).is_dir():
            raise LookupError(f"no checkpoint at {path}")
        marked = set(record.get("public", [])) - {f"{segment}/{name}"}
        record["public"] = sorted(marked | ({f"{segment}/{name}"} if public else set()))
        (self.root / run_id / RUN_FILE).write_text(json.dumps(record, indent=2) + "\n")
