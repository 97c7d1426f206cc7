"""Resuming a run (`--resume`): find the checkpoint to continue from, load it, cut the
log back to it, and say how the steps from there may differ from the uninterrupted
run's. Which checkpoints exist and what they hold is `checkpoint.py`'s; when a run
resumes is `run.py`'s.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefixgym.protocols import TrainingClient
from prefixgym.trainer.checkpoint import (
    ForeignCheckpointError,
    Found,
    LoopState,
    find_checkpoint,
    holds_optimizer,
    load_checkpoint,
    mark_latest,
    numerics_changes,
    remove_warm_start_steps,
)
from prefixgym.trainer.report import MetricsLog
from prefixgym.types import JSONObject


def checkpoint_to_resume(out: Path, identity: JSONObject, force: bool) -> Found:
    """`find_checkpoint`, with another run's checkpoint refused in words that say what
    to do instead."""
    try:
        return find_checkpoint(out, identity, force)
    except ForeignCheckpointError as e:
        raise ValueError(f"{e}: not resuming from it. Start without --resume (or with "
                         "another --out) for a new run, or pass --force-resume to load it "
                         "anyway") from None


def resume_from(path: Path, training: TrainingClient, log: MetricsLog | None,
                numerics: JSONObject | None) -> LoopState:
    """The state of checkpoint `path`, loaded into `training`, with `log` (rank 0's; None
    on the other ranks) cut back to it."""
    state = load_checkpoint(path, training)
    if log is None:
        return state
    mark_latest(path)  # a damaged `latest` names what was resumed from again
    if state.next_sft_step is None:
        log.truncate_after(state.next_step - 1)
        remove_warm_start_steps(path.parent)  # (a kill between saving warm_start and this)
        where = f"GRPO step {state.next_step}"
    else:
        log.truncate_in_warm_start(state.next_sft_step - 1)
        where = f"warm-start step {state.next_sft_step}"
    print(f"resuming from {path} at {where}", file=sys.stderr)
    changes = numerics_changes(path, numerics)
    if changes:
        print(f"note: this process computes otherwise than the saved steps "
              f"({'; '.join(changes)}): the steps from here will not repeat the "
              "uninterrupted run bit for bit (docs/architecture.md, "
              '"Determinism")', file=sys.stderr)
    if not holds_optimizer(path):
        print(f"note: {path} holds the weights without the optimizer's state "
              "(--no-checkpoint-optimizer): AdamW starts afresh here, so the steps "
              "from here differ from the uninterrupted run's", file=sys.stderr)
    return state
