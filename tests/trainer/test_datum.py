from prefixgym.rollouts.types import Trajectory, Turn
from prefixgym.trainer.datum import trajectory_to_datums


def _turn(prompt, sampled):
    return Turn(prompt_tokens=prompt, sampled_tokens=sampled,
                sampled_logprobs=[-0.1 * (i + 1) for i in range(len(sampled))],
                stop_reason="stop", reply_text="")


def test_extending_turns_merge_into_one_datum_with_weights_on_sampled_tokens():
    t0 = _turn([1, 2, 3], [10, 11])
    t1 = _turn([1, 2, 3, 10, 11, 4, 5], [12])
    traj = Trajectory("e", "g", 0, turns=[t0, t1])
    out = trajectory_to_datums(traj, advantage=2.0)
    assert out.num_splits == 0 and len(out.datums) == 1
    d = out.datums[0]
    full = [1, 2, 3, 10, 11, 4, 5, 12]
    assert d.model_input.tokens == full[:-1]
    assert d.loss_fn_inputs["target_tokens"] == full[1:]
    sampled = {10, 11, 12}
    assert d.loss_fn_inputs["weights"] == [1.0 if t in sampled else 0.0 for t in full[1:]]
    assert d.loss_fn_inputs["advantages"] == [2.0 * w for w in d.loss_fn_inputs["weights"]]
    # the sampler's logprobs sit exactly on the sampled targets
    lp = d.loss_fn_inputs["logprobs"]
    assert [lp[i] for i, w in enumerate(d.loss_fn_inputs["weights"]) if w] == [-0.1, -0.2, -0.1]
    assert d.num_loss_tokens == 3


def test_edited_history_splits_the_datum_and_counts_it():
    t0 = _turn([1, 2, 3], [10])
    t1 = _turn([1, 9, 3, 10, 4], [11])  # token 2 was changed: not an extension
    out = trajectory_to_datums(Trajectory("e", "g", 0, turns=[t0, t1]), advantage=1.0)
    assert out.num_splits == 1 and len(out.datums) == 2
    assert out.datums[1].model_input.tokens == [1, 9, 3, 10, 4]
    assert sum(d.num_loss_tokens for d in out.datums) == 2

