"""verifiers 0.4 tasksets by `--env verifiers:NAME` alone: the bridge turns verifiers'
chat requests into observations and the policy's replies into their answers, in this
process (tasksets: `vf_sums.py`, one reply; `vf_guess.py`, turns run by its own Env)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixgym.cli import main
from prefixgym.envs.base import agent_of, has_expert
from prefixgym.envs.registration import make_env

pytest.importorskip("verifiers.v1")

RUN = ["--sft-steps", "0", "--steps", "1", "--groups-per-step", "2", "--group-size", "2",
       "--eval-episodes", "3", "--max-tokens", "4", "--no-progress"]


def test_a_seed_picks_a_task_whose_system_prompt_and_reward_are_the_tasksets() -> None:
    a, b = make_env("verifiers:vf_sums"), make_env("verifiers:vf_sums")
    try:
        (qa,), _ = a.reset(seed=2)
        (qb,), _ = b.reset(seed=7)  # 7 % 5 tasks: the same task
        assert qa == qb == {"role": "user", "name": "", "content": "What is 3 + 3?"}
        assert agent_of(a).system_prompt == "Answer with a number."  # the task's own
        assert not has_expert(a)
        _, reward, terminated, _, info = a.step("6")
        assert (reward, terminated, info["is_success"]) == (1.0, True, True)
        assert info["reward_components"] == {"correct": 1.0}  # verifiers' own scorer
        _, reward, _, _, info = b.step("7")
        assert (reward, info["is_success"]) == (0.0, False)
    finally:
        a.close()
        b.close()


def test_the_tasksets_env_runs_the_turns_and_scores_the_episode() -> None:
    env = make_env("verifiers:vf_guess")
    try:
        env.reset(seed=1)  # the number is 6
        hints = [env.step(guess)[0] for guess in ("4", "7")]
        assert [h[0]["content"] for h in hints] == ["higher", "lower"]
        _, reward, terminated, _, info = env.step("6")
        assert (reward, terminated, info["is_success"]) == (1.0, True, True)
        # an episode the turn bound cuts short is abandoned, and the next one starts fresh
        short = make_env("verifiers:vf_guess", {"max_turns": 2})
        short.reset(seed=0)
        assert short.step("1")[0][0]["content"] == "higher"
        assert short.step("2")[3]  # truncated
        (first,), _ = short.reset(seed=0)
        assert first["content"] == "Guess my number from 1 to 8."
        assert short.step("3")[1:3] == (1.0, True)
        short.close()
    finally:
        env.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"colour": 1}, r"takes success_reward, max_turns, timeout_s and config; not \['colour'\]"),
    ({"config": 3}, "config must be an object"),
])
def test_bad_kwargs_are_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_env("verifiers:vf_sums", kwargs)


def test_an_unknown_taskset_is_one_line() -> None:
    with pytest.raises(ValueError) as e:
        make_env("verifiers:no_such_taskset_here")
    assert "verifiers cannot load 'no_such_taskset_here'" in str(e.value)
    assert "\n" not in str(e.value)


def test_train_and_rollout_run_a_verifiers_taskset(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--env", "verifiers:vf_guess", "--out", str(out), *RUN]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in records if r["phase"] == "grpo"]
    assert step["episodes/failed"] == 0 and step["turns/mean"] >= 1
    evals = [r for r in records if r["phase"] == "eval"]
    assert evals and all(e["eval/env_errors"] == 0 and e["eval/episodes"] == 3 for e in evals)
    assert main(["rollout", "--env", "verifiers:vf_guess", "--run", str(out),
                 "--groups", "1", "--group-size", "2"]) == 0
