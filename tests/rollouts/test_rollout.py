import asyncio
import io
import json

import gymnasium as gym
import pytest
from agent_envs import Lengthy

from prefixgym.local_service import LocalService
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts, TraceWriter


@pytest.fixture(scope="module")
def service():
    with LocalService(model="tiny", seed=0) as s:
        yield s


def _run(service, envs, seed=3, trace=None, temperature=1.0):
    rollouts = Rollouts(service.create_sampling_client(), service.tokenizer,
                        RolloutConfig(max_tokens=6, temperature=temperature), trace=trace)
    return asyncio.run(rollouts.run_group(envs, seed, "g0"))


def test_group_shares_one_first_request_and_prompts_extend(service):
    envs = [gym.make("tests/Lengthy-v0") for _ in range(4)]
    stream = io.StringIO()
    group = _run(service, envs, trace=TraceWriter(stream))
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    first = [r for r in lines if r["turn"] == 0]
    assert len(first) == 1 and first[0]["num_samples"] == 4
    assert len(first[0]["completion_tokens"]) == 4
    # the first prompt is prefilled once for the 4 episodes
    u = first[0]["usage"]
    assert u["prefill_computed_tokens"] + u["prefill_cached_tokens"] == len(first[0]["prompt_tokens"])
    assert len(lines) == 1 + 4  # turn 1 of each episode is its own request
    requests = {(r["episode_id"] if r["turn"] else None, r["turn"]): r for r in lines}
    for i, traj in enumerate(group.trajectories):
        assert len(traj.turns) == 2 and traj.extension_ok and not traj.failed
        t0, t1 = traj.turns
        # each turn's prompt, as sent, is the start of the episode's tokens, and each
        # reply sits in them exactly as sampled, with its logprobs beside it
        sent0, sent1 = requests[(None, 0)], requests[(traj.episode_id, 1)]
        assert traj.tokens[: t0.prompt_length] == sent0["prompt_tokens"]
        assert traj.tokens[: t1.prompt_length] == sent1["prompt_tokens"]
        assert traj.tokens[t0.reply_start : t0.reply_end] == sent0["completion_tokens"][i]
        assert traj.tokens[t1.reply_start : t1.reply_end] == sent1["completion_tokens"][0]
        assert len(traj.tokens) == len(traj.sampled_mask) == len(traj.logprobs)
        sampled = [j for j, m in enumerate(traj.sampled_mask) if m]
        assert sampled == [*range(t0.reply_start, t0.reply_end),
                           *range(t1.reply_start, t1.reply_end)]
        assert all(traj.logprobs[j] < 0 for j in sampled)
        assert all(traj.logprobs[j] == 0.0 for j in range(len(traj.tokens)) if j not in sampled)
    # later turns hit the cache on the history they share with the first turn
    later = [r for r in lines if r["turn"] == 1]
    block = service.cache_stats()["block_size"]
    for r in later:
        assert r["usage"]["prefill_cached_tokens"] >= len(first[0]["prompt_tokens"]) - block


def test_greedy_rollouts_are_reproducible(service):
    a = _run(service, [gym.make("tests/Lengthy-v0")], temperature=0.0)
    b = _run(service, [gym.make("tests/Lengthy-v0")], temperature=0.0)
    assert a.trajectories[0].tokens == b.trajectories[0].tokens


def test_env_that_raises_ends_its_episode_as_failed(service):
    envs = [gym.make("tests/Lengthy-v0", raise_on_seed=3) for _ in range(2)]
    group = _run(service, envs, seed=3)
    for traj in group.trajectories:
        assert traj.failed and "broken on purpose" in traj.error
        assert traj.stop_reason == "env_error"
    ok = _run(service, [gym.make("tests/Lengthy-v0", raise_on_seed=3)], seed=4)
    assert not ok.trajectories[0].failed


class _BrokenReset(gym.Wrapper):
    def reset(self, **kwargs):
        raise OSError("no connection")


def test_env_that_raises_in_reset_fails_alone(service):
    envs = [_BrokenReset(gym.make("tests/Lengthy-v0")), gym.make("tests/Lengthy-v0")]
    group = _run(service, envs)
    broken, ok = group.trajectories
    assert broken.failed and "no connection" in broken.error and not broken.turns
    assert not ok.failed and len(ok.turns) == 2


class _IOEnv(Lengthy):
    """An env that waits on I/O: it overrides areset and astep (and counts their calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.awaited: list[str] = []

    async def areset(self, *, seed=None, options=None):
        self.awaited.append("areset")
        await asyncio.sleep(0)
        return self.reset(seed=seed, options=options)

    async def astep(self, action):
        self.awaited.append("astep")
        await asyncio.sleep(0)
        return self.step(action)


class _Doubled(gym.RewardWrapper):
    def reward(self, reward):
        return 2 * float(reward) + 100


def test_an_env_that_waits_on_io_is_awaited(service):
    env = _IOEnv()
    [traj] = _run(service, [env]).trajectories
    assert env.awaited == ["areset", "astep", "astep"] and len(traj.turns) == 2
    assert all(t.reward < 100 for t in traj.turns)


@pytest.mark.parametrize("io", [False, True])
def test_wrappers_around_an_env_are_honoured(service, io):
    """A RewardWrapper's rewards and a TimeLimit's end reach the trajectory, also when the
    env underneath overrides astep (its wrapped step runs in a worker thread)."""
    inner = _IOEnv() if io else Lengthy()
    env = gym.wrappers.TimeLimit(_Doubled(inner), max_episode_steps=1)
    [traj] = _run(service, [env]).trajectories
    assert len(traj.turns) == 1 and traj.truncated and not traj.terminated
    assert traj.turns[0].reward >= 100  # the wrapper's reward, not the env's
    if io:
        assert inner.awaited == []  # wrappers are synchronous: reset and step through them


class _Rendezvous(Lengthy):
    """Its reset waits (on I/O, say) until every env of the group has begun resetting:
    resets one after another would never get there."""

    def __init__(self, met: dict[str, object], group: int) -> None:
        super().__init__()
        self.met, self.group = met, group

    async def areset(self, *, seed=None, options=None):
        self.met["arrived"] = int(self.met.get("arrived", 0)) + 1
        if self.met["arrived"] == self.group:
            self.met["all"].set()  # type: ignore[attr-defined]
        await asyncio.wait_for(self.met["all"].wait(), timeout=5)  # type: ignore[attr-defined]
        return self.reset(seed=seed, options=options)


def test_a_groups_envs_reset_together(service):
    async def run():
        met = {"all": asyncio.Event()}
        rollouts = Rollouts(service.create_sampling_client(), service.tokenizer,
                            RolloutConfig(max_tokens=4))
        return await rollouts.run_group([_Rendezvous(met, 3) for _ in range(3)], 3, "g0")

    group = asyncio.run(run())
    assert [t.failed for t in group.trajectories] == [False] * 3


class _TaskSystem(Lengthy):
    """A system prompt per task, set at reset (a dataset row's, say)."""

    def _reset_task(self) -> str:
        number = int(self.np_random.integers(1000))
        self.system_prompt = f"You are solving task {number}."
        return f"Say {number}."


def test_an_env_may_set_its_system_prompt_per_task(service):
    texts = {}
    for seed in (3, 4):
        group = _run(service, [_TaskSystem(), _TaskSystem()], seed=seed)
        a, b = (service.tokenizer.decode(t.tokens) for t in group.trajectories)
        first = a[: a.index("Say")]
        assert "You are solving task" in first and b.startswith(first)  # shared by the group
        texts[seed] = first
    assert texts[3] != texts[4]
    assert "Reply with anything" not in texts[3]
