"""--tracker tensorboard: every metrics.jsonl line's numbers also land in TensorBoard
event files (where the optional package is installed); bad names are refused."""

import json

import pytest

from prefixgym.cli.train import train
from prefixgym.trainer.config import TrainConfig

SMALL = dict(env="tests/Lengthy-v0", sft_steps=2, sft_episodes_per_step=2, groups_per_step=2,
             group_size=3, eval_episodes=4, eval_every=2, max_tokens=6, progress=False)


def test_an_unknown_tracker_is_refused():
    with pytest.raises(ValueError, match="--tracker must be tensorboard or empty"):
        TrainConfig(tracker="mlflow")


def test_metrics_also_go_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(TrainConfig(**SMALL, steps=2, out=str(tmp_path), tracker="tensorboard"))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])

    def series(tag):
        return [(s.step, s.value) for s in events.Scalars(tag)]

    grpo = [r for r in lines if r["phase"] == "grpo"]
    assert series("grpo/reward/mean") == [
        (r["step"], pytest.approx(r["reward/mean"], rel=1e-6)) for r in grpo]
    sft = [r for r in lines if r["phase"] == "sft"]
    assert [s for s, _ in series("sft/sft/loss")] == [r["sft_step"] for r in sft]
    evals = [r for r in lines if r["phase"] == "eval"]
    assert len(series("eval/eval/success")) == len(evals) == 3
    assert "grpo/tokens/prefill_cached" in tags and "grpo/step" not in tags
    assert (tmp_path / "report.md").exists() and (tmp_path / "training.png").exists()
