"""examples/nim.py: the env passes check_agent_env, its script runs, and its rules hold."""

import subprocess
import sys
from pathlib import Path

import pytest

from prefixgym.envs import check_agent_env
from prefixgym.envs.registration import make_agent_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nim.py"
SPEC = f"{EXAMPLE}:Nim"


def test_the_example_script_checks_the_env_and_plays_a_won_game():
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "check_agent_env(prefixgym_examples/Nim-v0): ok" in done.stdout
    assert done.stdout.rstrip().endswith("You win!")


def test_the_expert_wins_every_start_and_one_wrong_move_loses():
    env = make_agent_env(SPEC)
    check_agent_env(env, seeds=range(12))
    for seed in range(12):
        env.reset(seed=seed)
        game = env.unwrapped
        wrong = str(4 - int(game.expert_action())) if game.stones % 4 != 2 else "1"
        if wrong == game.expert_action():
            continue
        _, reward, terminated, _, info = env.step(wrong)
        while not terminated:  # the opponent now never misses its win
            _, reward, terminated, _, info = env.step(game.expert_action())
        assert not info["is_success"] and reward == 0.0


@pytest.mark.parametrize("reply", ["4", "0", "three", "", "2 stones"])
def test_a_reply_that_is_not_a_legal_move_is_invalid_and_the_game_goes_on(reply):
    env = make_agent_env(SPEC)
    env.reset(seed=0)
    stones = env.unwrapped.stones
    _, reward, terminated, _, info = env.step(reply)
    assert info["invalid_action"] and not terminated and reward < 0
    assert env.unwrapped.stones == stones
