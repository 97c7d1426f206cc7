"""Trajectory -> Datum: the episode's tokens, weights on sampled targets, scaled once."""

import pytest

from prefixgym.rollouts.types import Trajectory, Turn
from prefixgym.trainer.datum import loss_mask, num_loss_tokens, rl_datum, sft_datum, trainable


def _trajectory() -> Trajectory:
    # prefix [1, 2, 3], reply [10, 11], closing/user/header [4, 5], reply [12], closing [6]
    tokens = [1, 2, 3, 10, 11, 4, 5, 12, 6]
    sampled = [t in (10, 11, 12) for t in tokens]
    logprobs = {10: -0.1, 11: -0.2, 12: -0.3}
    return Trajectory(
        "e", "g", 0, turns=[Turn(3, 5, "stop"), Turn(7, 8, "stop")], tokens=tokens,
        sampled_mask=sampled, logprobs=[logprobs.get(t, 0.0) for t in tokens],
    )


def test_rl_datum_covers_the_episode_up_to_its_last_reply():
    traj = _trajectory()
    d = rl_datum(traj, advantage=2.0, batch_loss_tokens=4)
    covered = [1, 2, 3, 10, 11, 4, 5, 12]  # the closing after the last reply is not trained
    assert d.model_input.tokens == covered[:-1]
    assert d.loss_fn_inputs["target_tokens"] == covered[1:]
    weights = [1.0 if t in (10, 11, 12) else 0.0 for t in covered[1:]]
    assert d.loss_fn_inputs["weights"] == weights
    assert d.loss_fn_inputs["advantages"] == [2.0 * w / 4 for w in weights]
    # the sampler's logprobs sit exactly on the sampled targets
    lp = d.loss_fn_inputs["logprobs"]
    assert [lp[i] for i, w in enumerate(weights) if w] == [-0.1, -0.2, -0.3]
    assert d.num_loss_tokens == 3 == num_loss_tokens([traj]) == sum(loss_mask(traj))


def test_kl_penalty_applies_on_sampled_targets_only():
    traj = _trajectory()
    penalty = [float(i) for i in range(7)]
    d = rl_datum(traj, advantage=1.0, batch_loss_tokens=2, kl_penalty=penalty)
    weights = d.loss_fn_inputs["weights"]
    assert d.loss_fn_inputs["advantages"] == [
        (1.0 - k) / 2 if w else 0.0 for k, w in zip(penalty, weights)]


def test_sft_datum_weights_are_one_over_the_batch_loss_tokens():
    d = sft_datum(_trajectory(), batch_loss_tokens=6)
    assert set(d.loss_fn_inputs) == {"target_tokens", "weights"}
    assert sorted(set(d.loss_fn_inputs["weights"])) == [0.0, 1 / 6]


@pytest.mark.parametrize("change", ["failed", "no_turns", "nothing_sampled"])
def test_episodes_without_a_sampled_target_give_no_datum(change):
    traj = _trajectory()
    assert trainable(traj)
    if change == "failed":
        traj.failed = True
    elif change == "no_turns":
        traj.turns = []
    else:
        traj.sampled_mask = [False] * len(traj.tokens)
    assert not trainable(traj)
