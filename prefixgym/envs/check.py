"""check_agent_env: what every AgentEnv must satisfy, beyond Gymnasium's check_env.

1. `gymnasium.utils.env_checker.check_env` on the unwrapped env;
2. seeded determinism: the same seed and replies give the same episode;
3. the expert reaches `full_return` with `is_success` and no invalid reply (with
   `expert_noise` set to 0 for the check: a noisy expert errs on purpose);
4. garbage replies (empty, whitespace, random text, a huge string, broken tool
   calls) never raise, never succeed, and earn at most `reward_floor`;
5. no leak: no user message before the episode ends contains a `_leak_probes()`
   text as a whole word;
6. every info carries stop_reason, invalid_action, reward_components, is_success
   and num_invalid_actions.

This module knows the AgentEnv contract only: nothing of tokens or models.
"""

from __future__ import annotations

import re
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env, data_equivalence

from prefixgym.envs.base import AgentEnv, Observation

INFO_KEYS = ("stop_reason", "invalid_action", "reward_components", "is_success",
             "num_invalid_actions")
_GARBAGE_CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ !?.,;:'\"()[]{}<>/")


@dataclass
class CheckReport:
    """What check_agent_env found: `failures` is empty when the env passed."""

    env_name: str
    checks_run: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    expert_returns: list[float] = field(default_factory=list)
    garbage_returns: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        head = f"check_agent_env({self.env_name}): {'ok' if self.ok else 'FAILED'}"
        return "\n".join([head, *(f"  - {failure}" for failure in self.failures)])


def check_agent_env(
    env: gym.Env[Any, Any] | str,  # any env: its own spaces decide the types
    episodes: int = 3,
    seeds: Sequence[int] | None = None,
    *,
    raise_on_failure: bool = True,
    skip_gym_check: bool = False,
) -> CheckReport:
    """Run the checks above on `env` (an env or a registered id); raise
    AssertionError listing every failure unless `raise_on_failure=False`."""
    if isinstance(env, str):
        env = gym.make(env)
    agent = env.unwrapped
    if not isinstance(agent, AgentEnv):
        raise ValueError(f"check_agent_env needs an AgentEnv, got {type(agent).__name__}")
    seeds = list(seeds) if seeds is not None else list(range(episodes))
    if not seeds:
        raise ValueError("check_agent_env needs at least one seed")
    report = CheckReport(env_name=env.spec.id if env.spec else type(agent).__name__)

    def run(name: str, fn: Callable[[], None]) -> None:
        report.checks_run.append(name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn()
            except Exception as e:  # AssertionError included: record and go on
                where = traceback.extract_tb(e.__traceback__)[-1]
                report.failures.append(f"{name}: {type(e).__name__}: {e} "
                                       f"({where.filename.split('/')[-1]}:{where.lineno})")
        report.warnings += [f"{name}: {w.message}" for w in caught]

    if not skip_gym_check:
        run("gymnasium check_env", lambda: check_env(agent))
    run("seeded determinism", lambda: _check_determinism(env, agent, seeds))
    run("expert", lambda: _check_expert(env, agent, seeds, report))
    run("garbage", lambda: _check_garbage(env, agent, seeds, report))
    if raise_on_failure and report.failures:
        raise AssertionError(str(report))
    return report


def _episode(
    env: gym.Env[Any, Any], agent: AgentEnv, seed: int, policy: Callable[[int], str]
) -> tuple[list[object], float, dict[str, Any]]:  # gymnasium's info dict
    """One episode: (trace of every step, return, last info). Checks infos and leaks."""
    obs, info = env.reset(seed=seed)
    trace: list[object] = [obs]
    total = 0.0
    _check_leaks(agent, obs, "reset")
    for turn in range(agent.max_turns + 1):
        obs, reward, terminated, truncated, info = env.step(policy(turn))
        assert obs in agent.observation_space, f"turn {turn}: observation outside the space"
        missing = [k for k in INFO_KEYS if k not in info]
        assert not missing, f"turn {turn}: info lacks {missing}"
        assert isinstance(reward, float) and np.isfinite(reward), f"reward {reward!r}"
        trace.append((obs, reward, terminated, truncated))
        total += reward
        if terminated or truncated:
            return trace, total, info
        _check_leaks(agent, obs, f"turn {turn}")
    raise AssertionError(f"episode ran past max_turns={agent.max_turns}")


def _check_leaks(agent: AgentEnv, obs: Observation, where: str) -> None:
    for probe in agent._leak_probes():
        pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(probe)}(?![A-Za-z0-9_])")
        for message in obs:
            if message["role"] == "user" and pattern.search(message["content"]):
                raise AssertionError(f"{where}: the answer leaks: {probe!r} in "
                                     f"{message['content'][:200]!r}")


def _check_determinism(env: gym.Env[Any, Any], agent: AgentEnv, seeds: list[int]) -> None:
    for seed in seeds:
        first, second = _replay(env, agent, seed)
        assert data_equivalence(first, second), f"seed {seed}: two episodes differ"


def _replay(
    env: gym.Env[Any, Any], agent: AgentEnv, seed: int
) -> tuple[list[object], list[object]]:
    """An expert episode, then the same replies again after a reset with the same seed."""
    actions: list[str] = []

    def record(_: int) -> str:
        actions.append(agent.expert_action())
        return actions[-1]

    first, _, _ = _episode(env, agent, seed, record)
    second, _, _ = _episode(env, agent, seed, lambda turn: actions[turn])
    return first, second


def _check_expert(
    env: gym.Env[Any, Any], agent: AgentEnv, seeds: list[int], report: CheckReport
) -> None:
    noise, agent.expert_noise = agent.expert_noise, 0.0
    try:
        for seed in seeds:
            _expert_episode(env, agent, seed, report)
    finally:
        agent.expert_noise = noise


def _expert_episode(
    env: gym.Env[Any, Any], agent: AgentEnv, seed: int, report: CheckReport
) -> None:
    _, total, info = _episode(env, agent, seed, lambda _: agent.expert_action())
    report.expert_returns.append(total)
    assert info["is_success"], f"seed {seed}: expert failed ({info['stop_reason']})"
    assert info["num_invalid_actions"] == 0, f"seed {seed}: expert made invalid replies"
    assert total >= agent.full_return - 1e-9, (
        f"seed {seed}: expert return {total:.3f} < full_return {agent.full_return}")


def _check_garbage(
    env: gym.Env[Any, Any], agent: AgentEnv, seeds: list[int], report: CheckReport
) -> None:
    rng = np.random.default_rng(seeds[0])

    def random_text(_: int) -> str:
        return "".join(rng.choice(_GARBAGE_CHARS, size=int(rng.integers(1, 80))))

    policies: dict[str, Callable[[int], str]] = {
        "empty": lambda _: "",
        "whitespace": lambda _: " \n\t ",
        "words": lambda _: "I think the answer is probably something.",
        "emoji": lambda _: "\U0001f642" * 20 + "\x00",
        "huge": lambda _: "z" * 200_000,
        "unclosed tool call": lambda _: '<tool_call>{"name": ',
        "unknown tool": lambda _: '<tool_call>{"name": "no_such_tool", "arguments": {}}'
                                  "</tool_call>",
        "random text": random_text,
    }
    for i, (name, policy) in enumerate(policies.items()):
        seed = seeds[i % len(seeds)]
        _, total, info = _episode(env, agent, seed, policy)
        report.garbage_returns.append(total)
        assert not info["is_success"], f"garbage {name!r} succeeded (seed {seed})"
        assert total <= agent.reward_floor + 1e-9, (
            f"garbage {name!r} earned {total:.3f} > reward_floor {agent.reward_floor}")
