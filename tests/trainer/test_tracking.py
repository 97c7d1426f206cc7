"""--tracker tensorboard / trackio: every metrics.jsonl line's numbers also land in
TensorBoard event files or trackio's local store (each where its optional package is
installed), and a resumed run or one that starts over leaves there what metrics.jsonl
holds, each point once; bad names are refused."""

import json
import sys
from collections import defaultdict

import pytest

import prefixgym.trainer.run as run_module
from prefixgym.cli.train import train
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.tracking import tracker_step

SMALL = dict(env="tests/Lengthy-v0", sft_steps=3, sft_episodes_per_step=2, groups_per_step=2,
             group_size=3, eval_episodes=4, eval_every=2, max_tokens=6, progress=False)


def test_an_unknown_tracker_is_refused():
    with pytest.raises(ValueError, match="--tracker must be tensorboard, trackio or empty"):
        TrainConfig(tracker="mlflow")


class Killed(Exception):
    pass


def tensorboard_series(out) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # (size 0: every point kept)
    series = {tag: [(s.step, s.value) for s in events.Scalars(tag)]
              for tag in events.Tags()["scalars"]}
    return {tag: points for tag, points in series.items() if points}  # purged: empty


def trackio_series(out) -> dict[str, list[tuple[int, float]]]:
    from trackio.sqlite_storage import SQLiteStorage

    from prefixgym.trainer.tracking import TRACKIO_PROJECT, TrackioTracker

    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in SQLiteStorage.get_logs(TRACKIO_PROJECT, TrackioTracker(out).name):
        for tag, value in row.items():
            if "/" in tag:
                series[tag].append((row["step"], value))
    return dict(series)


def use_tracker(kind: str, tmp_path, monkeypatch):
    """The reader of `kind`'s store; skips where its package is not installed."""
    if kind == "tensorboard":
        pytest.importorskip("tensorboard")
        return tensorboard_series
    if "trackio" in sys.modules:
        pytest.skip("trackio was imported before: its store cannot be moved to tmp_path")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio-store"))  # read at import
    for name in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(name, raising=False)
    pytest.importorskip("trackio")
    return trackio_series


def metrics_series(out) -> dict[str, list[tuple[int, float]]]:
    """What metrics.jsonl says TensorBoard should hold, tag by tag in logging order."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key not in ("step", "sft_step") and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                series[f"{record['phase']}/{key}"].append((tracker_step(record), value))
    return dict(series)


@pytest.mark.parametrize("kind", ["tensorboard", "trackio"])
def test_metrics_go_to_the_tracker_once_each_through_resume_and_restart(
        kind, tmp_path, monkeypatch):
    read = use_tracker(kind, tmp_path, monkeypatch)
    out = tmp_path / "run"
    config = dict(SMALL, checkpoint_every=2, out=str(out), tracker=kind)
    save = run_module.save_checkpoint

    def save_then_die(out, training, state, *args, **kwargs):
        if state.next_step == 3:
            raise Killed  # step 2 and the evaluation after it are logged, not checkpointed
        return save(out, training, state, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(run_module, "save_checkpoint", save_then_die)
        with pytest.raises(Killed):
            train(TrainConfig(**config, steps=3))
    first = read(out)
    assert [step for step, _ in first["grpo/reward/mean"]] == [0, 1, 2]

    train(TrainConfig(**config, steps=3, resume=True))  # from step 2's checkpoint
    want, got = metrics_series(out), read(out)
    assert [step for step, _ in got["grpo/reward/mean"]] == [0, 1, 2]
    assert [step for step, _ in got["eval/eval/success"]] == [0, 2, 3]  # warm start, GRPO
    assert [step for step, _ in got["sft/sft/loss"]] == [0, 1, 2]  # step 2 was logged again
    assert got.keys() == want.keys()
    for tag, points in want.items():
        assert got[tag] == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], tag
    assert "grpo/tokens/prefill_cached" in got and "grpo/step" not in got
    assert (out / "report.md").exists() and (out / "training.png").exists()

    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])  # (seen above)
    train(TrainConfig(**{**config, "sft_steps": 0}, steps=1))  # a new run in the same OUT
    want, got = metrics_series(out), read(out)
    assert [step for step, _ in got["grpo/reward/mean"]] == [0]
    assert "sft/sft/loss" not in got  # the earlier run's points are out of view
    assert got.keys() == want.keys()
