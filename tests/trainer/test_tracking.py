"""--tracker tensorboard: every metrics.jsonl line's numbers also land in TensorBoard
event files (where the optional package is installed), and a resumed run or one that
starts over leaves there what metrics.jsonl holds, each point once; bad names are refused."""

import json
from collections import defaultdict

import pytest

import prefixgym.trainer.run as run_module
from prefixgym.cli.train import train
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.tracking import tracker_step

SMALL = dict(env="tests/Lengthy-v0", sft_steps=3, sft_episodes_per_step=2, groups_per_step=2,
             group_size=3, eval_episodes=4, eval_every=2, max_tokens=6, progress=False)


def test_an_unknown_tracker_is_refused():
    with pytest.raises(ValueError, match="--tracker must be tensorboard or empty"):
        TrainConfig(tracker="mlflow")


class Killed(Exception):
    pass


def tensorboard_series(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # keep every point
    events.Reload()
    series = {tag: [(s.step, s.value) for s in events.Scalars(tag)]
              for tag in events.Tags()["scalars"]}
    return {tag: points for tag, points in series.items() if points}  # purged: empty


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


def test_metrics_go_to_tensorboard_once_each_through_resume_and_restart(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    config = dict(SMALL, checkpoint_every=2, out=str(tmp_path),
                  tracker="tensorboard")
    save = run_module.save_checkpoint

    def save_then_die(out, training, state, *args, **kwargs):
        if state.next_step == 3:
            raise Killed  # step 2 and the evaluation after it are logged, not checkpointed
        return save(out, training, state, *args, **kwargs)

    monkeypatch.setattr(run_module, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        train(TrainConfig(**config, steps=3))
    monkeypatch.undo()
    first = tensorboard_series(tmp_path / "tensorboard")
    assert [step for step, _ in first["grpo/reward/mean"]] == [0, 1, 2]

    train(TrainConfig(**config, steps=3, resume=True))  # from step 2's checkpoint
    want, got = metrics_series(tmp_path), tensorboard_series(tmp_path / "tensorboard")
    assert [step for step, _ in got["grpo/reward/mean"]] == [0, 1, 2]
    assert [step for step, _ in got["eval/eval/success"]] == [0, 0, 2, 3]
    assert [step for step, _ in got["sft/sft/loss"]] == [0, 1, 2]  # step 2 was logged again
    assert got.keys() == want.keys()
    for tag, points in want.items():
        assert got[tag] == [(step, pytest.approx(value, rel=1e-6)) for step, value in points], tag
    assert "grpo/tokens/prefill_cached" in got and "grpo/step" not in got
    assert (tmp_path / "report.md").exists() and (tmp_path / "training.png").exists()

    train(TrainConfig(**{**config, "sft_steps": 0}, steps=1))  # a new run in the same OUT
    want, got = metrics_series(tmp_path), tensorboard_series(tmp_path / "tensorboard")
    assert [step for step, _ in got["grpo/reward/mean"]] == [0]
    assert "sft/sft/loss" not in got  # the earlier run's points are out of view
    assert got.keys() == want.keys()
