"""Bounded staleness (--max-staleness K): the steps the pipeline samples ahead, from
which weights, the lag each step trains at, exact resume, and a run's histogram."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from prefixgym.cli.train import train
from prefixgym.trainer import run as run_module
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.grpo import StepPipeline
from prefixgym.trainer.off_policy_report import staleness_lines

SMALL = dict(env="tests/Lengthy-v0", sft_steps=1, sft_episodes_per_step=2, groups_per_step=2,
             group_size=3, eval_episodes=1, eval_every=10, max_tokens=6, progress=False)


@dataclass(frozen=True)
class Version:
    weights_version: int


def _drive(k: int, steps: int, sync_before=lambda step: False) -> list[tuple[int, int, int]]:
    """(step, version it sampled from, lag it trains at) for a loop of `steps` updates."""
    drawn: dict[int, int] = {}

    def sample(sampler, step):
        drawn[step] = sampler.weights_version
        return [], 0.0

    pipeline = StepPipeline(sample, k, sync_before)
    out, newest = [], Version(0)
    pipeline.start(newest, 0)
    for step in range(steps):
        _, weights = pipeline.take(newest, step, steps)
        out.append((step, drawn[step], weights.expected_lag))
        assert weights.max_staleness == k
        newest = Version(step + 1)  # the update, published
        pipeline.after_update(newest, step, steps)
        pipeline.wait()
    pipeline.close()
    return out


@pytest.mark.parametrize(("k", "lags"), [
    (0, [0, 0, 0, 0, 0]),
    (1, [0, 1, 1, 1, 1]),  # --async
    (2, [0, 1, 2, 2, 2]),
    (3, [0, 1, 2, 3, 3]),
])
def test_each_step_samples_from_the_newest_weights_when_it_starts(k, lags):
    steps = _drive(k, 5)
    assert [lag for _, _, lag in steps] == lags
    assert [version + lag for step, version, lag in steps] == [0, 1, 2, 3, 4]  # = step


def test_a_checkpoint_makes_the_steps_after_it_wait_for_its_weights():
    steps = _drive(2, 6, sync_before=lambda step: step == 3)
    # step 3 waits for step 2's update; 4 and 5 start when 3 trains
    assert [lag for _, _, lag in steps] == [0, 1, 2, 0, 1, 2]


def test_async_is_a_staleness_of_one():
    assert TrainConfig(async_mode=True).staleness == 1
    assert TrainConfig(async_mode=True, max_staleness=3).staleness == 3
    assert TrainConfig().staleness == 0
    with pytest.raises(ValueError, match="--max-staleness must be >= 0"):
        TrainConfig(max_staleness=-1)
    # remote servers keep K + 1 adapters (tests/serving/test_remote_training.py)
    assert TrainConfig(max_staleness=2, sampler_url=["http://x/v1"]).staleness == 2


def test_a_run_at_staleness_two_logs_its_histogram_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])

    def grpo(out):
        lines = [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith("time/")}
                for r in lines if r["phase"] == "grpo"]

    config = dict(SMALL, steps=6, checkpoint_every=4, lr_schedule="constant", max_staleness=2)
    train(TrainConfig(**config, out=str(tmp_path / "a")))
    steps = grpo("a")
    # step 1 follows the warm start's evaluation and step 4 a checkpoint: each samples
    # from the newest weights, and the steps after it start over
    assert [r["sampler/version_lag"] for r in steps] == [0, 0, 1, 2, 0, 1]
    for r in steps:
        lag = int(r["sampler/version_lag"])
        assert r[f"staleness/{lag}"] + r["episodes/off_policy"] == 6 and r["episodes/stale"] == 0
    report = (tmp_path / "a" / "report.md").read_text()
    assert "## Staleness" in report
    # killed after the checkpoint, resumed: the same steps, bit for bit
    train(TrainConfig(**{**config, "steps": 4}, out=str(tmp_path / "b")))
    train(TrainConfig(**config, out=str(tmp_path / "b"), resume=True))
    assert grpo("b") == steps


def test_staleness_lines_sum_the_histogram_over_the_run():
    records = [{"phase": "grpo", "sampler/version_lag": 0, "staleness/0": 6, "episodes/stale": 0},
               {"phase": "grpo", "sampler/version_lag": 2, "staleness/2": 5,
                "episodes/stale": 0},
               {"phase": "grpo", "sampler/version_lag": 3, "staleness/3": 0,
                "episodes/stale": 6}]
    lines = staleness_lines(records)
    assert "| 0 | 6 |" in lines and "| 2 | 5 |" in lines and "| 3 | 0 |" in lines
    assert any("6 episodes were dropped" in line for line in lines)
    assert staleness_lines([{"phase": "grpo", "sampler/version_lag": 0, "staleness/0": 6,
                             "episodes/stale": 0}]) == []  # synchronous: nothing to say
