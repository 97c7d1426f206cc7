"""Which checkpoint a run resumes from: the newest intact one of this run. Damaged
ones (flipped byte, truncation, a `latest` naming nothing) are passed over with a
reason; another run's is refused unless forced; killed writes' temporaries are
removed. The metrics log survives a partial last line and is never deleted."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from prefixgym.futures import APIFuture
from prefixgym.trainer.checkpoint import (
    WARM_START,
    ForeignCheckpointError,
    LoopState,
    find_checkpoint,
    in_warm_start,
    load_checkpoint,
    numerics_changes,
    prune_checkpoints,
    remove_leftovers,
    remove_warm_start_steps,
    save_checkpoint,
)
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.identity import run_identity
from prefixgym.trainer.report import MetricsLog

IDENTITY = run_identity(TrainConfig())


class FileClient:
    """A training client whose whole state is one number, saved as a file."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def save_state(self, path: str | os.PathLike[str]) -> APIFuture[str]:
        Path(path).mkdir(parents=True)
        (Path(path) / "state.bin").write_bytes(self.value.to_bytes(4, "little") * 1000)
        return APIFuture.completed(str(path))

    def load_state(self, path: str | os.PathLike[str]) -> APIFuture[int]:
        self.value = int.from_bytes((Path(path) / "state.bin").read_bytes()[:4], "little")
        return APIFuture.completed(self.value)


def save(out: Path, step: int | None, identity: dict = IDENTITY) -> Path:
    """A checkpoint after GRPO step `step` (None: the warm start)."""
    state = LoopState(next_step=0 if step is None else step + 1)
    client = FileClient(100 if step is None else step)
    return save_checkpoint(out, client, state, identity,  # type: ignore[arg-type]
                           name=WARM_START if step is None else None)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_the_latest_checkpoint_of_this_run_is_found_and_loaded(tmp_path: Path) -> None:
    save(tmp_path, None)
    save(tmp_path, 1)
    latest = save(tmp_path, 3)
    found = find_checkpoint(tmp_path, IDENTITY)
    assert found.path == latest and found.passed_over == []
    client = FileClient()
    assert load_checkpoint(latest, client).next_step == 4  # type: ignore[arg-type]
    assert client.value == 3


def test_a_latest_naming_a_missing_directory_falls_back_to_the_newest_intact(
    tmp_path: Path,
) -> None:
    save(tmp_path, None)
    older = save(tmp_path, 1)
    (tmp_path / "checkpoints" / "latest").write_text("step-000007")
    found = find_checkpoint(tmp_path, IDENTITY)
    assert found.path == older
    assert "does not name a checkpoint directory ('step-000007')" in found.passed_over[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "manifest"])
def test_a_damaged_checkpoint_is_passed_over_with_its_reason(tmp_path: Path, damage: str) -> None:
    warm = save(tmp_path, None)
    newest = save(tmp_path, 1)
    state_file = newest / "train" / "state.bin"
    if damage == "flip":
        flip_a_byte(state_file)
    elif damage == "truncate":
        state_file.write_bytes(state_file.read_bytes()[:10])
    elif damage == "remove":
        (newest / "loop.json").unlink()
    else:
        (newest / "checkpoint.json").write_text("")
    found = find_checkpoint(tmp_path, IDENTITY)
    assert found.path == warm
    [reason] = found.passed_over
    assert str(newest) in reason
    with pytest.raises(ValueError):
        load_checkpoint(newest, FileClient())  # type: ignore[arg-type]


def test_nothing_intact_is_nothing_found(tmp_path: Path) -> None:
    flip_a_byte(save(tmp_path, 0) / "loop.json")
    found = find_checkpoint(tmp_path, IDENTITY)
    assert found.path is None and "is damaged" in found.passed_over[0]
    assert find_checkpoint(tmp_path / "elsewhere", IDENTITY).path is None


def test_another_runs_checkpoint_is_refused_unless_forced(tmp_path: Path) -> None:
    theirs = {**IDENTITY, "seed": 1, "lr": 0.1}
    save(tmp_path, None, theirs)
    foreign = save(tmp_path, 2, theirs)
    with pytest.raises(ForeignCheckpointError,
                       match=rf"step-000002 belongs to another run \(lr: {IDENTITY['lr']} here, "
                             r"0\.1 there; seed: 0 here, 1 there\)"):
        find_checkpoint(tmp_path, IDENTITY)
    forced = find_checkpoint(tmp_path, IDENTITY, force=True)
    assert forced.path == foreign and "loaded anyway" in forced.passed_over[0]


def test_this_runs_older_checkpoint_wins_over_another_runs_newer_one(tmp_path: Path) -> None:
    save(tmp_path, 9, {**IDENTITY, "seed": 5})  # a run that used this --out before
    mine = save(tmp_path, None)
    assert find_checkpoint(tmp_path, IDENTITY).path == mine


def test_resumable_fields_are_not_part_of_the_identity() -> None:
    base = TrainConfig()
    same = TrainConfig(steps=500, eval_every=3, checkpoint_every=7, out="x", resume=True,
                       force_resume=True, progress=False, num_threads=2,
                       sampler_url="http://h:1/v1", nonfinite_update="error")
    assert run_identity(base) == run_identity(same)
    for change in ({"seed": 1}, {"lr": 1e-3}, {"group_size": 4}, {"eval_episodes": 10},
                   {"env_kwargs": {"max_turns": 5}}, {"compute_dtype": "float32"}):
        assert run_identity(TrainConfig(**change)) != run_identity(base), change  # type: ignore[arg-type]


def test_leftover_temporaries_of_killed_writes_are_removed(tmp_path: Path) -> None:
    keep = save(tmp_path, 0)
    root = tmp_path / "checkpoints"
    (root / ".step-000010.k2j3.tmp" / "train").mkdir(parents=True)
    (root / ".step-000010.k2j3.tmp" / "train" / "w.safetensors").write_bytes(b"x" * 1000)
    (root / ".latest.ab12.tmp").write_text("step-000010")
    (tmp_path / ".metrics.jsonl.zz.tmp").write_text("{}")
    assert remove_leftovers(tmp_path) == [".metrics.jsonl.zz.tmp", ".latest.ab12.tmp",
                                          ".step-000010.k2j3.tmp"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", keep.name]


def test_pruning_keeps_the_newest_step_checkpoints_the_one_just_written_and_the_warm_start(
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkpoints"
    save(tmp_path, None)
    saved = [save(tmp_path, step) for step in (9, 999_998, 1_000_000)]  # in number order
    assert prune_checkpoints(root, 2, saved[-1]) == ["step-000009"]
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step-1000000", "step-999998", WARM_START]
    assert prune_checkpoints(root, 0, saved[-1]) == []  # 0 keeps every one
    # a run resumed from an older checkpoint writes one numbered below the newest
    older = save(tmp_path, 19)
    assert prune_checkpoints(root, 1, older) == ["step-999998"]
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step-000019", "step-1000000", WARM_START]
    assert find_checkpoint(tmp_path, IDENTITY).path == older  # `latest` names it


def test_the_warm_starts_own_checkpoints_come_last_and_go_when_it_ends(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    client = FileClient(7)
    sft = [save_checkpoint(tmp_path, client, LoopState(next_step=0, next_sft_step=n),  # type: ignore[arg-type]
                           IDENTITY) for n in (2, 10, 4)]
    assert [p.name for p in sft] == ["sft-000001", "sft-000009", "sft-000003"]
    assert not (root / "latest").exists()  # `latest` names step checkpoints only
    assert prune_checkpoints(root, 2, sft[-1]) == ["sft-000001"]
    found = find_checkpoint(tmp_path, IDENTITY)
    assert found.path == sft[1] and load_checkpoint(sft[1], client).next_sft_step == 10  # type: ignore[arg-type]
    assert in_warm_start(sft[1]) and not in_warm_start(root / WARM_START)
    warm = save(tmp_path, None)
    assert find_checkpoint(tmp_path, IDENTITY).path == warm  # the warm start's end wins
    assert remove_warm_start_steps(root) == ["sft-000009", "sft-000003"]
    assert sorted(p.name for p in root.iterdir()) == [WARM_START]


def test_a_loop_state_saved_before_warm_starts_resumed_has_ended_its_warm_start() -> None:
    saved = {"next_step": 3, "evals": [], "usage": {}, "sft_usage": {}, "wall_s": 1.0}
    assert LoopState.from_json(json.dumps(saved), Path("loop.json")).next_sft_step is None
    state = LoopState(next_step=0, next_sft_step=5)
    assert LoopState.from_json(state.to_json(), Path("loop.json")) == state


def test_a_partial_last_metrics_line_is_dropped_and_truncation_rewrites_it(
    tmp_path: Path,
) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(3):
        log.write({"step": step, "phase": "grpo"})
    with open(log.path, "a") as f:
        f.write('{"step": 3, "phase": "gr')  # the process died here
    assert [r["step"] for r in log.read()] == [0, 1, 2]
    log.truncate_after(1)
    assert log.path.read_text() == ('{"step": 0, "phase": "grpo"}\n'
                                    '{"step": 1, "phase": "grpo"}\n')


def test_truncation_in_the_warm_start_keeps_the_first_evaluation_and_its_steps_to_there(
    tmp_path: Path,
) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 0, "phase": "eval", "when": "before training"})
    for sft_step in range(4):
        log.write({"step": 0, "phase": "sft", "sft_step": sft_step})
    log.truncate_in_warm_start(1)
    assert [(r["phase"], r.get("sft_step")) for r in log.read()] == [
        ("eval", None), ("sft", 0), ("sft", 1)]


def test_a_bad_metrics_line_elsewhere_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON line"):
        log.read()


def test_the_metrics_log_is_set_aside_never_deleted(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    assert log.set_aside() is None
    for n in (1, 2):
        log.write({"run": n})
        assert log.set_aside() == tmp_path / f"metrics.{n}.jsonl"
    assert [json.loads((tmp_path / f"metrics.{n}.jsonl").read_text()) for n in (1, 2)] == [
        {"run": 1}, {"run": 2}]
    assert not log.path.exists()


@pytest.mark.parametrize(("field", "old_value", "new_value"), [
    ("eval_temperature", 0.0, 1.0),  # runs saved before it evaluated greedily
    ("sft_lr_schedule", "cosine", "constant"),  # ... and warmed up on the cosine
    ("sft_warmup", 0.1, 0.0),  # ... over 10% of the steps
    ("sft_stages", [], [{"steps": 400, "env_kwargs": {"max_turns": 5}}]),  # ... one expert
])
def test_a_run_saved_before_a_field_existed_resumes_as_what_it_did(
    tmp_path: Path, field: str, old_value: object, new_value: object,
) -> None:
    as_it_ran = run_identity(TrainConfig(**{field: old_value}))
    saved = save(tmp_path, 4, {k: v for k, v in as_it_ran.items() if k != field})
    assert find_checkpoint(tmp_path, as_it_ran).path == saved
    with pytest.raises(ForeignCheckpointError,
                       match=re.escape(f"{field}: {new_value!r} here, {old_value!r} there")):
        find_checkpoint(tmp_path, run_identity(TrainConfig(**{field: new_value})))


@pytest.mark.parametrize(("correction", "ran_as"), [("tis", "trainer"), ("none", "sampler")])
def test_a_correction_saved_before_its_ratio_was_a_choice_resumes_decoupled(
    tmp_path: Path, correction: str, ran_as: str,
) -> None:
    """Corrections took the decoupled form before --off-policy-ratio existed; a run
    without one resumes under the new default, where the field changes nothing."""
    as_it_ran = run_identity(TrainConfig(off_policy_correction=correction,
                                         off_policy_ratio=ran_as))
    saved = save(tmp_path, 4, {k: v for k, v in as_it_ran.items() if k != "off_policy_ratio"})
    assert find_checkpoint(tmp_path, as_it_ran).path == saved


def test_a_resume_that_rounds_otherwise_is_told(tmp_path: Path) -> None:
    """What changes a step's bits: the dtype or the device always, the thread count only
    outside fp32 (MKL's strict mode: docs/architecture.md "Determinism")."""
    saved = {"compute_dtype": "bfloat16", "threads": 2, "device": "cpu (Xeon, with amx_bf16)"}
    path = save_checkpoint(tmp_path, FileClient(), LoopState(next_step=1), IDENTITY,
                           numerics=saved)
    assert numerics_changes(path, saved) == []
    assert numerics_changes(path, {**saved, "threads": 1}) == ["threads 2 -> 1"]
    assert numerics_changes(path, {**saved, "compute_dtype": "float32", "threads": 1}) == [
        "compute_dtype bfloat16 -> float32"]
    assert numerics_changes(path, {**saved, "device": "cuda:0 (H200)"}) == [
        "device cpu (Xeon, with amx_bf16) -> cuda:0 (H200)"]
    assert numerics_changes(path, None) == []  # the hosted service: unknown
    older = save_checkpoint(tmp_path, FileClient(), LoopState(next_step=2), IDENTITY)
    assert numerics_changes(older, saved) == []  # saved before checkpoints said
