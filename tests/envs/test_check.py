"""check_agent_env finds what is wrong with an env, and the tutorial env passes it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

from prefixgym.envs import AgentEnv, Outcome, check_agent_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "new_env.py"


class Parrot(AgentEnv):
    """Say the secret word. Variants below break one rule each."""

    system_prompt = "Say the word."
    word = "alpha"

    def __init__(self, render_mode: str | None = None) -> None:
        super().__init__(max_turns=3, render_mode=render_mode)

    def _reset_task(self) -> str:
        self.word = ["alpha", "bravo", "delta"][int(self.np_random.integers(3))]
        return "Which word?"

    def _act(self, text: str) -> Outcome:
        ok = text.strip() == self.word
        return Outcome("Yes." if ok else "No.", rewards={"success": float(ok)}, done=True,
                       success=ok)

    def expert_action(self) -> str:
        return self.word

    def _leak_probes(self) -> list[str]:
        return [self.word]


class LeakyParrot(Parrot):
    def _reset_task(self) -> str:
        super()._reset_task()
        return f"Which word? (psst: {self.word})"


class GenerousParrot(Parrot):
    def _act(self, text: str) -> Outcome:
        outcome = super()._act(text)
        outcome.rewards["effort"] = 0.5
        return outcome


class CluelessExpert(Parrot):
    def expert_action(self) -> str:
        return "zulu"


class UnseededParrot(Parrot):
    counter = 0

    def _reset_task(self) -> str:
        UnseededParrot.counter += 1
        self.word = ["alpha", "bravo", "delta"][UnseededParrot.counter % 3]
        return f"Which word? Round {UnseededParrot.counter}."


def test_a_good_env_passes() -> None:
    report = check_agent_env(Parrot(), seeds=[0, 1, 2])
    assert report.ok and report.expert_returns == [1.0, 1.0, 1.0]
    assert "garbage" in report.checks_run and max(report.garbage_returns) == 0.0


@pytest.mark.parametrize(
    ("env_cls", "expected"),
    [
        (LeakyParrot, "the answer leaks"),
        (GenerousParrot, "reward_floor"),
        (CluelessExpert, "expert failed"),
        (UnseededParrot, "seeded determinism"),
    ],
)
def test_broken_envs_are_reported(env_cls: type[AgentEnv], expected: str) -> None:
    report = check_agent_env(env_cls(), seeds=[0, 1], raise_on_failure=False,
                             skip_gym_check=True)
    assert not report.ok
    assert any(expected in failure for failure in report.failures), report.failures
    with pytest.raises(AssertionError, match="FAILED"):
        check_agent_env(env_cls(), seeds=[0, 1], skip_gym_check=True)


def test_check_agent_env_rejects_non_agent_envs() -> None:
    with pytest.raises(ValueError, match="AgentEnv"):
        check_agent_env(gym.make("CartPole-v1"))


def test_tutorial_env_passes_check_agent_env() -> None:
    spec = importlib.util.spec_from_file_location("new_env_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = check_agent_env(gym.make(module.ENV_ID), seeds=range(6))
    assert report.ok and len(EXAMPLE.read_text().splitlines()) <= 80


def test_tutorial_example_runs_as_a_script() -> None:
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert ": ok" in result.stdout and "[assistant]" in result.stdout


@pytest.mark.parametrize(("env_id", "max_turns"),
                         [("prefixgym/GuessNumber-v0", 5), ("prefixgym/Arithmetic-v0", 3)])
def test_a_noisy_expert_is_checked_without_its_noise(env_id: str, max_turns: int) -> None:
    env = gym.make(env_id, expert_noise=0.5, max_turns=max_turns)
    agent = env.unwrapped
    assert isinstance(agent, AgentEnv)
    failed = 0
    for seed in range(8):  # the noise is real: some of these episodes fail
        agent.reset(seed=seed)
        while True:
            _, _, terminated, truncated, info = agent.step(agent.expert_action())
            if terminated or truncated:
                break
        failed += not info["is_success"]
    assert failed > 0
    report = check_agent_env(env, seeds=range(8), skip_gym_check=True)
    assert report.ok and min(report.expert_returns) >= agent.full_return
    assert agent.expert_noise == 0.5
