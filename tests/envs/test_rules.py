"""The rules and rewards of each built-in env, as their docstrings state them."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from prefixgym.envs import (
    Addition,
    Arithmetic,
    GridMaze,
    GuessNumber,
    KeyValueLookup,
    Mastermind,
)
from prefixgym.envs.arithmetic import calculator
from prefixgym.envs.mastermind import score
from prefixgym.prompting.tools import format_tool_call


def test_guess_number_hints_range_and_bonus() -> None:
    env = GuessNumber(low=1, high=16, max_turns=8)
    env.reset(seed=0)
    secret = env._secret
    lower_guess = 1 if secret > 1 else 16
    obs, reward, *_ = env.step(str(lower_guess))
    if lower_guess < secret:
        assert obs[0]["content"] == "Higher. The number is between 2 and 16."
    else:
        assert obs[0]["content"] == "Lower. The number is between 1 and 15."
    assert reward == 0.0
    _, reward, terminated, _, info = env.step(f" {secret}\n")
    assert terminated and info["is_success"]
    assert info["reward_components"] == {"success": 1.0, "speed": pytest.approx(0.2 * 7 / 8)}


@pytest.mark.parametrize("reply", ["0", "17", "eight", "8 9", "8.5", ""])
def test_guess_number_invalid_replies(reply: str) -> None:
    env = GuessNumber()
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step(reply)
    assert info["invalid_action"] and reward == pytest.approx(-0.1) and not terminated
    assert obs[0]["content"].startswith("Invalid.")


def test_guess_number_without_range_hint_and_expert_is_binary_search() -> None:
    env = GuessNumber(low=1, high=100, max_turns=8, show_range=False)
    for seed in range(30):
        env.reset(seed=seed)
        for _ in range(7):  # ceil(log2(100)) = 7
            obs, _, terminated, _, info = env.step(env.expert_action())
            if terminated:
                break
            assert obs[0]["content"] in ("Higher.", "Lower.")
        assert info["is_success"]
    with pytest.raises(ValueError, match="low < high"):
        GuessNumber(low=5, high=5)


def test_guess_number_progress_credit_sums_to_the_range_narrowed() -> None:
    env = GuessNumber(low=1, high=64, max_turns=6, progress_credit=0.5)
    for seed in range(20):  # binary search: the credits add up to all 0.5 on success
        env.reset(seed=seed)
        progress, info = [], {}
        while not (info.get("is_success") or env.turn == env.max_turns):
            _, _, _, _, info = env.step(env.expert_action())
            progress.append(info["reward_components"]["progress"])
        if info["is_success"]:
            assert sum(progress) == pytest.approx(0.5)
    env.reset(seed=0)
    first = 1 if env._secret > 32 else 64
    _, reward, *_ = env.step("32")  # 64 possible -> 32 (or 31): about a sixth of the credit
    assert reward == pytest.approx(0.5 * math.log(64 / (env._hi - env._lo + 1)) / math.log(64))
    _, reward, *_ = env.step(str(first))  # outside the possible range: nothing narrowed
    assert reward == 0.0
    with pytest.raises(ValueError, match="progress_credit"):
        GuessNumber(progress_credit=1.5)


def _guess_number_expert(env: GuessNumber, seed: int) -> tuple[int, list[str], bool]:
    """The secret, the expert's guesses and whether it won, for one seed."""
    env.reset(seed=seed)
    secret, guesses, info = env._secret, [], {}
    while not (info.get("is_success") or env.turn == env.max_turns):
        guess = env.expert_action()
        assert env.expert_action() == guess  # asking again draws nothing new
        lo, hi = env._lo, env._hi
        guesses.append(guess)
        _, _, _, _, info = env.step(guess)
        assert lo <= int(guess) <= hi  # always inside the range still possible
    return secret, guesses, bool(info["is_success"])


def test_guess_number_expert_noise() -> None:
    exact, noisy, uniform = (GuessNumber(max_turns=4, expert_noise=p) for p in (0.0, 0.5, 1.0))
    episodes = {p: [_guess_number_expert(env, s) for s in range(300)]
                for p, env in ((0.0, exact), (0.5, noisy), (1.0, uniform))}
    # the noise is drawn after the secret: the same tasks at every noise level
    assert [e[0] for e in episodes[0.0]] == [e[0] for e in episodes[0.5]]
    assert all(g[0] == "8" for _, g, _ in episodes[0.0])  # binary search: the midpoint
    firsts = {p: sum(g[0] == "8" for _, g, _ in episodes[p]) for p in (0.5, 1.0)}
    assert 120 < firsts[0.5] < 200 and firsts[1.0] < 60  # 1/2 + 1/32 and 1/16 expected
    wins = {p: sum(w for *_, w in episodes[p]) for p in episodes}
    assert wins[0.0] > wins[0.5] > wins[1.0]  # noise costs the expert wins
    assert episodes[0.5] == [_guess_number_expert(noisy, s) for s in range(300)]  # replayed
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="expert_noise must be a number in 0..1"):
            GuessNumber(expert_noise=bad)  # type: ignore[arg-type]


def test_calculator_is_safe_and_exact() -> None:
    assert calculator("(7 + 12) * 3 - 5") == "52"
    assert calculator("7 / 2") == "3.5" and calculator("8 / 2") == "4"
    for bad in ["__import__('os')", "2 ** 10", "x + 1", "a" * 600]:
        with pytest.raises(ValueError):
            calculator(bad)


def test_arithmetic_tool_then_answer() -> None:
    env = Arithmetic(num_operands=4, max_value=9)
    obs, _ = env.reset(seed=2)
    question = obs[0]["content"]
    assert question.startswith("What is (") and question.endswith("?")
    obs, reward, terminated, _, _ = env.step(env.expert_action())
    assert obs[0]["role"] == "tool" and obs[0]["content"] == str(env._answer)
    assert (reward, terminated) == (0.0, False)
    _, reward, terminated, _, info = env.step(str(env._answer + 1))
    assert (reward, terminated, info["is_success"]) == (0.0, True, False)


def _expert_episode(env: Arithmetic, seed: int) -> tuple[str, list[str], bool]:
    """The question, the expert's replies and whether it won, for one seed."""
    obs, _ = env.reset(seed=seed)
    replies: list[str] = []
    while True:
        replies.append(env.expert_action())
        _, _, terminated, truncated, info = env.step(replies[-1])
        if terminated or truncated:
            return obs[0]["content"], replies, bool(info["is_success"])


def test_arithmetic_expert_tool_rate() -> None:
    always, never, some = (Arithmetic(expert_tool_rate=r) for r in (1.0, 0.0, 0.3))
    uses_tool = []
    for seed in range(400):
        question, replies, won = _expert_episode(some, seed)
        # the task of a seed does not depend on the rate; the expert wins either way
        assert question == _expert_episode(always, seed)[0] == _expert_episode(never, seed)[0]
        assert won and _expert_episode(some, seed) == (question, replies, won)  # replays
        uses_tool.append(replies[0].startswith("<tool_call>"))
        assert len(replies) == (2 if uses_tool[-1] else 1)
        if not uses_tool[-1]:
            assert replies == [str(some._answer)]
    assert 0.23 < sum(uses_tool) / len(uses_tool) < 0.37  # 0.3 ± 3 binomial SE
    assert _expert_episode(never, 5)[1] == [str(never._answer)]
    assert _expert_episode(always, 5)[1][0].startswith("<tool_call>")


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan"), "0.3", True])
def test_arithmetic_expert_tool_rate_must_be_a_share(rate: object) -> None:
    with pytest.raises(ValueError, match="expert_tool_rate must be a number in 0..1"):
        Arithmetic(expert_tool_rate=rate)  # type: ignore[arg-type]


def test_arithmetic_expert_noise_mistypes_the_last_operand_and_loses() -> None:
    exact, noisy = Arithmetic(), Arithmetic(expert_noise=0.4)
    mistyped, typed = 0, set()
    for seed in range(400):
        question, replies, won = _expert_episode(noisy, seed)
        assert question == _expert_episode(exact, seed)[0]  # the task does not change
        assert _expert_episode(noisy, seed) == (question, replies, won)  # replays
        asked = question.removeprefix("What is ").removesuffix("?")
        called = json.loads(replies[0].removeprefix("<tool_call>")
                            .removesuffix("</tool_call>"))["arguments"]["expression"]
        assert replies[1] == calculator(called)  # it answers the tool's result
        if called == asked:
            assert won
            continue
        mistyped += 1
        head, last = asked.rsplit(" ", 1)
        typed_head, typed_last = called.rsplit(" ", 1)
        assert typed_head == head and typed_last != last
        typed.add(int(typed_last))
        assert not won  # operands >= 1: another last operand never gives the same value
    assert 0.33 < mistyped / 400 < 0.47  # 0.4 ± 3 binomial SE
    assert typed == set(range(1, noisy.max_value + 1))  # every value, the ends included
    with pytest.raises(ValueError, match="expert_noise must be a number in 0..1"):
        Arithmetic(expert_noise=1.5)


def test_mastermind_scoring_and_feedback() -> None:
    assert score("AABB", "ABAB") == (2, 2)
    assert score("ABCD", "DCBA") == (0, 4)
    assert score("AAAA", "ABCD") == (1, 0)
    env = Mastermind(code_length=4, num_colors=6, max_turns=2)
    env.reset(seed=0)
    guess = "ABCD" if env._code != "ABCD" else "ABCE"
    obs, *_ = env.step(guess.lower())
    exact, misplaced = score(guess, env._code)
    assert obs[0]["content"] == f"{guess}: {exact} exact, {misplaced} misplaced."
    _, reward, _, truncated, _ = env.step("ZZZZ")  # invalid, but the last turn: partial
    assert truncated and reward == pytest.approx(0.3 * exact / 4 - 0.1)


def test_mastermind_expert_solves_every_code_in_eight() -> None:
    env = Mastermind(code_length=3, num_colors=4, max_turns=8)
    env.reset(seed=0)
    for code in itertools.product("ABCD", repeat=3):
        env.reset(seed=0)
        env._code = "".join(code)
        for _ in range(8):
            _, _, terminated, _, info = env.step(env.expert_action())
            if terminated:
                break
        assert info["is_success"], code


def test_grid_maze_moves_blocked_and_progress_credit() -> None:
    env = GridMaze(size=5, wall_density=0.0, max_turns=20)
    env.reset(seed=0)
    start = env._start_dist
    best = env.expert_action()
    obs, reward, *_ = env.step(best)
    assert reward == pytest.approx(0.5 / start) and "Goal:" in obs[0]["content"]
    back = {"up": "down", "down": "up", "left": "right", "right": "left"}[best]
    _, reward, *_ = env.step(back)
    assert reward == pytest.approx(-0.5 / start)
    env._pos = (0, 0)
    obs, reward, _, _, info = env.step("up")
    assert obs[0]["content"].startswith("Blocked.\n##") and reward == 0.0
    assert not info["invalid_action"]
    _, reward, _, _, info = env.step("north")
    assert info["invalid_action"] and reward == pytest.approx(-0.1)


def test_grid_maze_view_marks_agent_walls_and_goal() -> None:
    env = GridMaze(size=3, wall_density=0.0)
    env.reset(seed=0)
    env._pos, env._goal = (0, 0), (0, 2)
    assert env._view() == "###\n#A.\n#..\nGoal: 2 right."


def test_key_value_lookup_two_hops_and_partial_credit() -> None:
    env = KeyValueLookup(num_keys=5)
    obs, _ = env.reset(seed=0)
    question_key = env._question_key
    assert question_key in obs[0]["content"] and env._middle_key not in obs[0]["content"]
    obs, reward, *_ = env.step(format_tool_call("lookup", {"key": question_key}))
    assert obs[0] == {"role": "tool", "name": "lookup", "content": env._middle_key}
    obs, *_ = env.step(format_tool_call("lookup", {"key": "nope"}))
    assert obs[0]["content"] == "No key 'nope' in the store."
    _, reward, terminated, _, info = env.step(env._middle_key)
    assert (reward, terminated, info["is_success"]) == (0.2, True, False)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("  " + env._answer + "\n")
    assert (reward, terminated, info["is_success"]) == (1.0, True, True)


def test_tool_schemas_off_names_each_tool_and_its_arguments_in_the_system_text() -> None:
    env = KeyValueLookup(tool_schemas=False)
    system, tools = env.prompt()
    assert system == f"{KeyValueLookup.system_prompt} Tools: lookup(key)." and tools == []
    assert env.tools[0].name == "lookup"  # the tool still runs
    default = KeyValueLookup()
    assert default.prompt() == (KeyValueLookup.system_prompt, default.tools)
    assert GuessNumber().prompt() == (GuessNumber.system_prompt, [])
    with pytest.raises(ValueError, match="tool_schemas must be true or false"):
        Arithmetic(tool_schemas="no")  # type: ignore[arg-type]


@pytest.mark.parametrize(("reply", "reward", "success"), [
    ("38", 1.0, True), ("The sum of 5 and 33 is 38.", 1.0, True), ("5 + 33 = 38", 1.0, True),
    ("38 or 39", 0.0, False), ("-38", 0.0, False), ("5 + 33", 0.0, False)])
def test_addition_reads_the_replys_last_integer(reply: str, reward: float, success: bool) -> None:
    env = Addition(max_value=40)
    env.reset(seed=0)
    env._answer = 38  # the task of seed 0 aside: the reading is what is tested
    _, r, terminated, truncated, info = env.step(reply)
    assert (r, info["is_success"], terminated, truncated) == (reward, success, True, False)


def test_addition_without_an_integer_is_invalid_and_ends_the_episode() -> None:
    env = Addition(invalid_penalty=0.5)
    env.reset(seed=3)
    _, r, terminated, truncated, info = env.step("I cannot say.")
    assert (r, terminated, truncated, info["num_invalid_actions"]) == (-0.5, True, False, 1)
    assert not info["is_success"]
    with pytest.raises(ValueError, match="max_value"):
        Addition(max_value=0)


def test_addition_of_three_numbers_asks_them_all_and_says_so() -> None:
    env = Addition(terms=3, max_value=9)
    (message,), _ = env.reset(seed=4)
    numbers = [int(n) for n in message["content"].removeprefix("What is ").rstrip("?")
               .split(" + ")]
    assert len(numbers) == 3 and all(1 <= n <= 9 for n in numbers)
    assert env.prompt()[0].startswith("Add the numbers.")
    assert Addition().prompt()[0].startswith("Add the two numbers.")  # (unchanged at 2)
    _, r, terminated, _, info = env.step(f"{' + '.join(map(str, numbers))} = {sum(numbers)}")
    assert (r, terminated, info["is_success"]) == (1.0, True, True)
    # two terms ask what they asked before `terms` existed: the same draws
    assert Addition(terms=2).reset(seed=4)[0][0]["content"] == "What is 72 + 94?"
    for bad in (1, 9, True, 2.0):
        with pytest.raises(ValueError, match="terms must be an int in 2..8"):
            Addition(terms=bad)  # type: ignore[arg-type]
