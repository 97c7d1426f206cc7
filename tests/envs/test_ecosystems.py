"""Envs of other ecosystems by `--env PREFIX:NAME` alone: reasoning-gym's tasks,
TextArena's and GEM's games."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prefixgym.cli import main
from prefixgym.envs.base import agent_of, has_expert
from prefixgym.envs.ecosystems import ecosystem_of
from prefixgym.envs.registration import absolute_spec, make_env

pytest.importorskip("reasoning_gym")
pytest.importorskip("textarena")
pytest.importorskip("gem")

SUMS = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
        "allow_negation": False, "allow_parentheses": False}


def test_a_seed_asks_one_question_scored_by_the_datasets_own_scorer() -> None:
    a, b = make_env("reasoning_gym:leg_counting"), make_env("reasoning_gym:leg_counting")
    (qa,), _ = a.reset(seed=7)
    (qb,), _ = b.reset(seed=7)
    assert qa == qb and "legs" in qa["content"]  # one question per seed, in every env
    assert b.reset(seed=8)[0][0]["content"] != qa["content"]
    agent = agent_of(a)
    assert has_expert(a)
    answer = agent.expert_action()
    _, reward, terminated, _, info = a.step(answer)
    assert (reward, terminated, info["is_success"]) == (1.0, True, True)
    a.reset(seed=7)
    _, reward, _, _, info = a.step(f"<answer>{answer}</answer>")  # reasoning-gym's tags
    assert (reward, info["is_success"]) == (1.0, True)
    a.reset(seed=7)
    _, reward, _, _, info = a.step(str(int(answer) + 1))
    assert (reward, info["is_success"]) == (0.0, False)


def test_partial_credit_is_the_scorers_unless_turned_off() -> None:
    loose = make_env("reasoning_gym:leg_counting")
    strict = make_env("reasoning_gym:leg_counting", {"partial_credit": False})
    for env in (loose, strict):
        env.reset(seed=3)
    wordy = f"The answer is {agent_of(loose).expert_action()}"
    _, paid, _, _, info = loose.step(wordy)
    assert 0.0 < paid < 1.0 and not info["is_success"]  # it merely contains the answer
    assert strict.step(wordy)[1] == 0.0


@pytest.mark.parametrize(("spec", "kwargs", "message"), [
    ("reasoning_gym:no_such_task", {}, r"reasoning-gym has no task 'no_such_task'; its \d+ "
                                       r"tasks include"),
    ("reasoning_gym:a:b", {}, r"reasoning-gym has no task 'a:b'"),  # the name keeps its colons
    ("reasoning_gym:leg_counting", {"bogus": 1}, r"reasoning-gym refuses leg_counting with "
                                                 r"\{'bogus': 1.*unexpected keyword"),
    ("reasoning_gym:leg_counting", {"min_animals": 5, "max_animals": 1},
     r"max_animals must be >= min_animals"),
    ("reasoning_gym:leg_counting", {"partial_credit": "yes"}, r"partial_credit must be true or "
                                                              r"false, got 'yes'"),
])
def test_what_reasoning_gym_refuses_is_one_line(spec: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        make_env(spec, kwargs)
    assert "\n" not in str(err.value) and spec in str(err.value)


def test_without_the_package_the_line_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs the reasoning-gym package: pip install "
                                         r"'prefixgym\[reasoning-gym\]'"):
        make_env("reasoning_gym:leg_counting")


def test_the_prefix_ends_at_the_first_colon() -> None:
    assert ecosystem_of("reasoning_gym:game:Guess-v0") == "reasoning_gym"
    assert ecosystem_of("my_envs:Hangman") is None and ecosystem_of("reasoning_gym:") is None
    assert absolute_spec("reasoning_gym:leg_counting") == "reasoning_gym:leg_counting"


def test_train_runs_a_task_without_a_glue_file(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--env", "reasoning_gym:basic_arithmetic", "--env-kwargs",
                 '{"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]}',
                 "--out", str(out), "--steps", "1", "--sft-steps", "2",
                 "--sft-episodes-per-step", "4", "--groups-per-step", "2", "--group-size", "2",
                 "--eval-episodes", "4", "--max-tokens", "4", "--no-progress"]) == 0
    assert "reasoning_gym:basic_arithmetic" in (out / "report.md").read_text()


GAMES = ["textarena:GuessTheNumber-v0-raw", "gem:game:GuessTheNumber-v0-easy"]


@pytest.mark.parametrize("spec", GAMES)
def test_a_game_is_replayed_by_its_seed_and_the_expert_bisects_to_a_win(spec: str) -> None:
    a, b = make_env(spec), make_env(spec)
    assert a.reset(seed=5)[0] == b.reset(seed=5)[0]
    agent = agent_of(a)
    assert has_expert(a)
    for _ in range(10):
        reply = agent.expert_action()
        _, reward, terminated, truncated, info = a.step(reply)
        b.step(reply)
        if terminated or truncated:
            break
    assert (reward, terminated, info["is_success"]) == (1.0, True, True)
    assert b.reset(seed=6)[0] == make_env(spec).reset(seed=6)[0]
    a.close()
    b.close()


def test_a_textarena_invalid_move_is_an_invalid_reply() -> None:
    env = make_env("textarena:GuessTheNumber-v0-raw")
    env.reset(seed=1)
    obs, reward, terminated, _, info = env.step("[500]")  # outside the range
    assert info["invalid_action"] and not terminated and reward < 0
    assert "invalid move" in obs[0]["content"]


@pytest.mark.parametrize(("spec", "message"), [
    ("textarena:TicTacToe-v0-raw", r"textarena cannot make TicTacToe-v0-raw for one player "
                                   r"with \{\}: AssertionError: The number of players has to "
                                   r"be 2"),
    ("gem:game:NoSuch", r"gem cannot make game:NoSuch with \{\}: ValueError: Environment "
                        r"game:NoSuch not found"),
])
def test_what_a_game_library_refuses_is_one_line(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        make_env(spec)
    assert "\n" not in str(err.value)


def test_a_game_without_an_expert_asks_for_no_warm_start() -> None:
    assert not has_expert(make_env("gem:game:Minesweeper-v0-easy"))


@pytest.mark.parametrize("spec", GAMES)
def test_train_plays_a_game_without_a_glue_file(spec: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--env", spec, "--out", str(out), "--steps", "1", "--sft-steps", "2",
                 "--sft-episodes-per-step", "2", "--groups-per-step", "1", "--group-size", "2",
                 "--eval-episodes", "2", "--max-tokens", "6", "--no-progress"]) == 0
    assert spec in (out / "report.md").read_text()
