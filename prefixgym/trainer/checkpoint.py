"""Resumable run state: the training client's state plus the loop's own, saved atomically
and verified before it is used.

Layout under OUT/checkpoints/:
  step-000009/train/            the training client's save_state (weights, optimizer, RNG;
                                without the optimizer's state with --no-checkpoint-optimizer)
  step-000009/loop.json         next step, evaluations so far, cumulative usage
  step-000009/config.json      the run's full resolved config (when the run gave it)
  step-000009/numerics.json    how its steps were computed: dtype, threads, device (idem)
  step-000009/checkpoint.json   the run's identity and a checksum of every file above
  warm_start/...                the same, after the warm start (the KL reference)
  sft-000009/...                the same, in the middle of the warm start (after its
                                step 9); deleted once warm_start is saved
  latest                        the name of the newest complete step checkpoint

`prune_checkpoints` keeps the newest step checkpoints (the run's `keep_checkpoints`),
or the newest warm-start ones, and deletes the older ones; the warm start's is never
deleted.

Each checkpoint is written into a temporary directory and renamed into place, and
`latest` is replaced atomically after it (`prefixgym.files`), so a crash leaves the
previous one intact; `remove_leftovers` deletes what killed writes left behind.

`find_checkpoint` is how a run picks what to resume from: `latest`, then the other
step checkpoints newest first, then the warm start, then the checkpoints in the middle
of the warm start newest first -- the first one that is intact
(every checksum matches) and belongs to this run (same identity, `run_identity` in
config.py). A damaged one is passed over with a reason; one of another run is
refused unless forced. Knows the training client's save/load protocol and JSON;
nothing of models.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from prefixgym.files import (
    TEMPORARY_SUFFIX,
    file_checksum,
    remove_temporaries,
    verify_checksums,
    write_dir_atomically,
    write_text_atomically,
)
from prefixgym.protocols import TrainingClient
from prefixgym.trainer.identity import with_added_fields
from prefixgym.types import JSONObject, Usage

WARM_START = "warm_start"
NUMERICS = "numerics.json"
LATEST = "latest"
MANIFEST = "checkpoint.json"
FORMAT_VERSION = 1
_STEP_NAME = re.compile(r"step-\d{6,}")
_SFT_NAME = re.compile(r"sft-\d{6,}")


@dataclass
class LoopState:
    next_step: int
    evals: list[JSONObject] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    sft_usage: Usage = field(default_factory=Usage)
    wall_s: float = 0.0
    next_sft_step: int | None = None
    """The warm-start step to go on from; None once the warm start is done (or there
    is none). Checkpoints written before warm starts were resumable have none."""

    def to_json(self) -> str:
        return json.dumps({
            "next_step": self.next_step, "evals": self.evals,
            "usage": self.usage.model_dump(), "sft_usage": self.sft_usage.model_dump(),
            "wall_s": self.wall_s, "next_sft_step": self.next_sft_step,
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: Path) -> LoopState:
        try:
            d = json.loads(text)
            sft = d.get("next_sft_step")
            return cls(int(d["next_step"]), list(d["evals"]), Usage(**d["usage"]),
                       Usage(**d["sft_usage"]), float(d["wall_s"]),
                       None if sft is None else int(sft))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where} is not a loop state: {type(e).__name__}: {e}") from None


class ForeignCheckpointError(ValueError):
    """The only intact checkpoints belong to another run."""


@dataclass
class Found:
    """What `find_checkpoint` chose, and what it passed over and why."""

    path: Path | None
    passed_over: list[str] = field(default_factory=list)


def checkpoint_name(state: LoopState) -> str:
    """A step checkpoint's name (`step-000009`), or one in the middle of the warm start's
    (`sft-000009`), after the last step `state` has done."""
    if state.next_sft_step is not None:
        return f"sft-{state.next_sft_step - 1:06d}"
    return f"step-{state.next_step - 1:06d}"


def in_warm_start(path: Path) -> bool:
    """Whether checkpoint `path` was saved in the middle of the warm start."""
    return bool(_SFT_NAME.fullmatch(path.name))


def save_checkpoint(
    out: Path, training: TrainingClient, state: LoopState, identity: JSONObject,
    name: str | None = None,
    config: JSONObject | None = None,
    numerics: JSONObject | None = None,
    with_optimizer: bool = True,
) -> Path:
    """Write checkpoint `name` (by default the state's step name) under `out`, whole or
    not at all, and point `latest` at it; `with_optimizer=False` leaves the optimizer's
    state out (its manifest says so: `holds_optimizer`)."""
    root = out / "checkpoints"
    name = name or checkpoint_name(state)

    def fill(tmp: Path) -> None:
        if with_optimizer:
            training.save_state(tmp / "train")
        else:
            training.save_state(tmp / "train", with_optimizer=False)
        (tmp / "loop.json").write_text(state.to_json())
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if numerics is not None:
            (tmp / NUMERICS).write_text(json.dumps(numerics, sort_keys=True) + "\n")
        checksums = {str(p.relative_to(tmp)): file_checksum(p)
                     for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"format": FORMAT_VERSION, "run": identity, "checksums": checksums,
                    "optimizer": with_optimizer}
        (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True))

    write_dir_atomically(root / name, fill)
    mark_latest(root / name)
    return root / name


def mark_latest(checkpoint: Path) -> None:
    """Point `latest` at a step checkpoint (the warm start is never `latest`)."""
    pointer = checkpoint.parent / LATEST
    if _STEP_NAME.fullmatch(checkpoint.name) and not (
            pointer.is_file() and pointer.read_bytes() == checkpoint.name.encode()):
        write_text_atomically(pointer, checkpoint.name)


def step_checkpoints(root: Path, pattern: re.Pattern[str] = _STEP_NAME) -> list[str]:
    """The names of the step checkpoints in `root` (OUT/checkpoints), newest first (with
    `pattern` _SFT_NAME: those in the middle of the warm start)."""
    if not root.is_dir():
        return []
    return sorted((p.name for p in root.iterdir() if pattern.fullmatch(p.name)),
                  key=lambda n: int(n.partition("-")[2]), reverse=True)


def prune_checkpoints(root: Path, keep: int, written: Path) -> list[str]:
    """Delete the checkpoints in `root` of `written`'s kind (GRPO steps, or warm-start
    steps) but the newest `keep` and `written` (the one just saved); keep=0 deletes none.
    Returns the names deleted."""
    if keep <= 0:
        return []
    pattern = _SFT_NAME if in_warm_start(written) else _STEP_NAME
    old = [n for n in step_checkpoints(root, pattern)[keep:] if n != written.name]
    _delete(root, old)
    return old


def remove_warm_start_steps(root: Path) -> list[str]:
    """Delete the checkpoints in the middle of the warm start (once its end is saved)."""
    names = step_checkpoints(root, _SFT_NAME)
    _delete(root, names)
    return names


def _delete(root: Path, names: list[str]) -> None:
    """Each goes by a rename to a temporary name first, so that a kill half-way leaves a
    leftover for `remove_leftovers`, never a damaged checkpoint that resuming would have
    to pass over."""
    for name in names:
        doomed = root / f".{name}.deleted{TEMPORARY_SUFFIX}"
        os.replace(root / name, doomed)
        shutil.rmtree(doomed)


def remove_leftovers(out: Path) -> list[str]:
    """Delete the temporaries of killed writes in OUT and OUT/checkpoints."""
    return remove_temporaries(out) + remove_temporaries(out / "checkpoints")


def verify_checkpoint(path: Path) -> JSONObject:
    """The run identity a checkpoint records, once every checksum in its manifest
    matches and it lists loop.json and the training state. ValueError otherwise."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    if not manifest_path.is_file():
        raise ValueError(f"{manifest_path} is missing (an incomplete checkpoint, or one "
                         "written by an older prefixgym)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{manifest_path} is not readable JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{manifest_path} is not a format-{FORMAT_VERSION} checkpoint manifest")
    checksums, identity = manifest.get("checksums"), manifest.get("run")
    if (not isinstance(checksums, dict) or "loop.json" not in checksums
            or not any(name.startswith("train/") for name in checksums)
            or not isinstance(identity, dict)):
        raise ValueError(f"{manifest_path} must list loop.json, the training state and the "
                         "run's identity")
    verify_checksums(path, checksums, manifest_path)
    return identity


def differences(mine: JSONObject, theirs: JSONObject) -> str:
    """`field: here X, there Y` for each field where two identities differ."""
    keys = sorted(set(mine) | set(theirs))
    return "; ".join(f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} there"
                     for k in keys if mine.get(k) != theirs.get(k))


def candidates(out: Path, passed_over: list[str]) -> list[Path]:
    """Where a run may resume from, in order: `latest`, the other step checkpoints
    newest first, the warm start, the warm start's steps newest first. A `latest` that
    names nothing usable is noted."""
    root = out / "checkpoints"
    names: list[str] = []
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if _STEP_NAME.fullmatch(name) and (root / name).is_dir():
            names.append(name)
        else:
            passed_over.append(f"{pointer} does not name a checkpoint directory ({name[:40]!r})")
    names += step_checkpoints(root)
    names.append(WARM_START)
    names += step_checkpoints(root, _SFT_NAME)
    return [root / name for name in dict.fromkeys(names)]


def find_checkpoint(out: Path, identity: JSONObject | None, force: bool = False) -> Found:
    """The newest intact checkpoint of the run with `identity` (None: of any run).

    Damaged checkpoints are passed over (their reasons in `passed_over`). When the
    only intact ones belong to another run, raises ForeignCheckpointError naming the
    fields that differ, unless `force`, which takes the newest of them."""
    found = Found(None)
    foreign: list[tuple[Path, JSONObject]] = []
    for path in candidates(out, found.passed_over):
        if not path.exists():  # no warm start (yet)
            continue
        try:
            theirs = verify_checkpoint(path)
        except ValueError as e:
            found.passed_over.append(str(e))
            continue
        theirs = with_added_fields(theirs)
        if identity is None or theirs == identity:
            found.path = path
            return found
        foreign.append((path, theirs))
    if foreign and identity is not None:
        path, theirs = foreign[0]
        if force:
            found.path = path
            found.passed_over.append(f"{path} belongs to another run "
                                     f"({differences(identity, theirs)}); loaded anyway "
                                     "(--force-resume)")
            return found
        raise ForeignCheckpointError(
            f"{path} belongs to another run ({differences(identity, theirs)})")
    return found


def load_warm_start(out: Path, identity: JSONObject, training: TrainingClient,
                    resumed_from: Path, force: bool = False) -> None:
    """Load the warm-start weights of run `identity` in `out` (a resumed run's KL
    reference), checked; ValueError when they are damaged or another run's."""
    warm = out / "checkpoints" / WARM_START
    try:
        theirs = verify_checkpoint(warm)
    except ValueError as e:
        raise ValueError(f"--kl-coef needs the warm-start weights as its reference: {e}") \
            from None
    if theirs != identity and not force:
        raise ValueError(f"{warm} (the KL reference) belongs to another run than "
                         f"{resumed_from}")
    load_checkpoint(warm, training)


def numerics_changes(path: Path, now: JSONObject | None) -> list[str]:
    """How this process computes otherwise than the steps saved in checkpoint `path`, in
    ways that round differently: the compute dtype (`auto` decides by device), the device
    (a GPU, or the CPU and its kind), or, outside float32 (where MKL's strict mode makes
    the thread count change no bits), the thread count. Empty when nothing differs or
    either side is unknown."""
    saved_file = path / NUMERICS
    if now is None or not saved_file.is_file():
        return []
    saved = json.loads(saved_file.read_text())
    keys = ["compute_dtype", "device"]
    if now.get("compute_dtype") != "float32":
        keys.append("threads")
    return [f"{key} {saved.get(key)} -> {now.get(key)}" for key in keys
            if saved.get(key) != now.get(key)]


def holds_optimizer(path: Path) -> bool:
    """Whether checkpoint `path` holds the optimizer's state (its manifest says; those
    written before it could say all do)."""
    manifest = json.loads((path / MANIFEST).read_text())
    return manifest.get("optimizer", True) is not False


def load_checkpoint(path: Path, training: TrainingClient) -> LoopState:
    """Load a checkpoint `verify_checkpoint` accepted (it is verified again here)."""
    verify_checkpoint(path)
    state = LoopState.from_json((path / "loop.json").read_text(), path / "loop.json")
    training.load_state(path / "train")
    return state
