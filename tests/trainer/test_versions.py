"""On-policy checks: the version lag a step expects, and samples from other weights refused."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from prefixgym.rollouts.types import Trajectory, TrajectoryGroup, Turn
from prefixgym.trainer.versions import StepWeights, keep_on_policy, logprob_mismatch
from prefixgym.types import Datum, ForwardBackwardOutput, ModelInput


@dataclass
class Sampler:  # what a pinned remote sampler says of itself
    weights_version: int
    label: str | None = None

    def sample(self, *args, **kwargs):  # pragma: no cover - never sampled here
        raise AssertionError

    def compute_logprobs(self, *args, **kwargs):  # pragma: no cover
        raise AssertionError


def group(*labels_per_episode: list[str | None]) -> TrajectoryGroup:
    trajs = []
    for i, labels in enumerate(labels_per_episode):
        turns = [Turn(0, 1, "stop", weights_version=label) for label in labels]
        trajs.append(Trajectory(episode_id=f"g/{i}", group_id="g", seed=1, turns=turns))
    return TrajectoryGroup("g", 1, trajs)


def test_samples_from_the_pinned_weights_are_kept_others_refused() -> None:
    groups = [group(["r-3", "r-3"], ["r-3", "r-2"], [None])]
    kept, metrics = keep_on_policy(groups, StepWeights(Sampler(3, "r-3"), Sampler(3, "r-3"), 0))
    assert [t.episode_id for t in kept[0].trajectories] == ["g/0", "g/2"]
    assert metrics == {"sampler/version_lag": 0.0, "episodes/off_policy": 1.0,
                       "episodes/stale": 0.0, "staleness/0": 2.0}


@pytest.mark.parametrize(("used", "newest", "expected_lag", "refused"), [
    (4, 5, 1, 0),   # async: exactly one behind
    (5, 5, 1, 2),   # async expected one behind, got the newest
    (3, 5, 1, 2),   # two behind
    (4, 5, 0, 2),   # sync expected the newest
])
def test_a_step_from_the_wrong_version_is_refused_whole(used, newest, expected_lag, refused):
    groups = [group([None], [None])]
    kept, metrics = keep_on_policy(groups, StepWeights(Sampler(used), Sampler(newest),
                                                       expected_lag))
    assert metrics["sampler/version_lag"] == newest - used
    assert metrics["episodes/off_policy"] == refused
    assert len(kept[0].trajectories) == 2 - refused
    assert metrics["episodes/stale"] == (refused if newest - used > 1 else 0)


@pytest.mark.parametrize(("lag", "max_staleness", "stale"), [
    (2, 2, 0),  # K = 2: two behind is allowed
    (3, 2, 2),  # three behind: both samples dropped as stale
    (0, 0, 0),
])
def test_samples_older_than_k_are_dropped_and_counted(lag, max_staleness, stale):
    groups = [group([None], [None])]
    kept, metrics = keep_on_policy(groups, StepWeights(Sampler(10 - lag), Sampler(10), lag,
                                                       max_staleness))
    assert metrics["episodes/stale"] == metrics["episodes/off_policy"] == stale
    assert len(kept[0].trajectories) == 2 - stale
    assert metrics[f"staleness/{lag}"] == 2 - stale  # the histogram counts what trained


def test_samplers_that_do_not_say_are_not_checked() -> None:
    class Plain:
        pass

    kept, metrics = keep_on_policy([group(["x"])], StepWeights(Plain(), Plain(), 1))  # type: ignore[arg-type]
    assert len(kept[0].trajectories) == 1 and "sampler/version_lag" not in metrics


def test_logprob_mismatch_looks_at_trained_tokens_only() -> None:
    datum = Datum(model_input=ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={
        "target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0],
        "logprobs": [-9.0, -1.0, -2.0], "advantages": [0.0, 1.0, 1.0]})
    out = ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": [-1.0, -1.25, -1.5]}],
                                metrics={"off_policy/weight": 0.9, "off_policy/capped": 0.5})
    metrics = logprob_mismatch([datum], out)
    # d = trainer - sampler = -0.25 and 0.5 on the two trained tokens
    k3 = [math.expm1(d) - d for d in (-0.25, 0.5)]
    assert metrics == pytest.approx({
        "sampler/max_logprob_gap": 0.5, "sampler/mean_logprob_gap": 0.375,
        "sampler/kl_k3": sum(k3) / 2, "off_policy/weight_mean": 0.9,
        "off_policy/capped_fraction": 0.5})
