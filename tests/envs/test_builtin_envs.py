"""Every registered env: Gymnasium's check_env, check_agent_env, experts on many
seeds, seeded replay, garbage that never raises, and vector envs."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env, data_equivalence
from hypothesis import given
from hypothesis import strategies as st

from prefixgym.envs import BUILTIN_ENVS, AgentEnv, check_agent_env

ENV_IDS = sorted(BUILTIN_ENVS)


def make(env_id: str, **kwargs: Any) -> AgentEnv:
    env = gym.make(env_id, **kwargs).unwrapped
    assert isinstance(env, AgentEnv)
    return env


def expert_episode(env: AgentEnv, seed: int) -> tuple[list[Any], float, dict[str, Any]]:
    steps: list[Any] = [env.reset(seed=seed)]
    total = 0.0
    while True:
        action = env.expert_action()
        obs, reward, terminated, truncated, info = env.step(action)
        steps.append((action, obs, reward, terminated, truncated))
        total += float(reward)
        if terminated or truncated:
            return steps, total, info


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_gymnasium_check_env(env_id: str) -> None:
    check_env(make(env_id))


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_check_agent_env_passes(env_id: str) -> None:
    report = check_agent_env(gym.make(env_id), seeds=range(4))
    assert report.ok and len(report.expert_returns) == 4
    assert all(r <= 0.0 for r in report.garbage_returns)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_expert_reaches_full_reward_on_many_seeds(env_id: str) -> None:
    env = make(env_id)
    for seed in range(40):
        _, total, info = expert_episode(env, seed)
        assert info["is_success"], (seed, env.render())
        assert info["num_invalid_actions"] == 0 and total >= env.full_return


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_seeded_reset_replays_the_episode(env_id: str) -> None:
    a, b = make(env_id), make(env_id)
    assert data_equivalence(expert_episode(a, 11), expert_episode(b, 11))
    assert a.reset(seed=3)[0] == b.reset(seed=3)[0]
    a.reset(seed=3)
    b.reset(seed=4)
    b.reset(seed=3)  # a reset in between does not change what seed 3 gives
    assert data_equivalence(expert_episode(a, 3), expert_episode(b, 3))


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_episodes_differ_across_seeds(env_id: str) -> None:
    env = make(env_id)
    transcripts = set()
    for seed in range(8):
        expert_episode(env, seed)
        transcripts.add(str(env.transcript))
    assert len(transcripts) > 1


@pytest.mark.parametrize("env_id", ENV_IDS)
@given(replies=st.lists(st.text(max_size=60), min_size=1, max_size=6))
def test_random_text_never_raises(env_id: str, replies: list[str]) -> None:
    env = make(env_id)
    env.reset(seed=0)
    for reply in replies:
        obs, reward, terminated, truncated, info = env.step(reply)
        assert obs in env.observation_space and isinstance(info["invalid_action"], bool)
        assert -1.0 <= float(reward) <= 1.5
        if terminated or truncated:
            break


@pytest.mark.parametrize("env_id", ENV_IDS)
@pytest.mark.parametrize("reply", ["", " ", "x" * 1_000_000, "\x00\n" * 1000, "<tool_call>" * 50])
def test_empty_and_huge_replies_are_invalid_or_wrong(env_id: str, reply: str) -> None:
    env = make(env_id)
    env.reset(seed=1)
    _, reward, _, _, info = env.step(reply)
    assert float(reward) <= 0.0 and not info["is_success"]


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_render_ansi_returns_transcript(env_id: str) -> None:
    env = make(env_id, render_mode="ansi")
    env.reset(seed=0)
    env.step(env.expert_action())
    text = env.render()
    assert isinstance(text, str) and text.startswith("[system]\n" + env.system_prompt)
    assert "[assistant]" in text


def test_sync_vector_env_runs_experts() -> None:
    multi_turn = [e for e in ENV_IDS if e != "prefixgym/Addition-v0"]  # (one reply ends it)
    envs = gym.vector.SyncVectorEnv([lambda i=i: gym.make(multi_turn[i]) for i in range(3)])
    obs, _ = envs.reset(seed=[0, 1, 2])
    assert len(obs) == 3 and all(o[0]["role"] == "user" for o in obs)
    actions = tuple(e.unwrapped.expert_action() for e in envs.envs)
    obs, rewards, terminated, truncated, info = envs.step(actions)
    assert rewards.shape == (3,) and list(info["invalid_action"]) == [False] * 3
    assert not any(terminated) and not any(truncated)  # no expert finishes in one reply
    envs.close()


def test_async_vector_env_needs_shared_memory_off() -> None:
    fns = [lambda: gym.make("prefixgym/GuessNumber-v0") for _ in range(2)]
    with pytest.raises(TypeError, match="shared_memory"):
        gym.vector.AsyncVectorEnv(fns)
    envs = gym.vector.AsyncVectorEnv(fns, shared_memory=False)
    try:
        obs, _ = envs.reset(seed=[4, 4])
        assert obs[0] == obs[1]
        _, rewards, _, _, info = envs.step(("8", "eight"))
        assert rewards[0] >= 0.0 and rewards[1] < 0.0 and list(info["invalid_action"]) == [
            False, True]
    finally:
        envs.close()


def test_group_of_envs_reset_with_one_seed_share_the_prompt() -> None:
    group = [make(ENV_IDS[0]) for _ in range(4)]
    prompts = {str(env.reset(seed=123)[0]) for env in group}
    assert len(prompts) == 1
    assert len({env.system_prompt for env in group}) == 1
