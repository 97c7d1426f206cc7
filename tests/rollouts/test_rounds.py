"""Lockstep rounds: every live episode's next request in one round, in episode order,
and rollouts that give the same bits on a deterministic engine, run after run."""

import asyncio

import gymnasium as gym

from prefixgym.futures import APIFuture
from prefixgym.local_service import LocalService
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts
from prefixgym.rollouts.rounds import Rounds
from prefixgym.types import SampledSequence, SampleRequest, SampleResponse


class RecordingSampler:
    """Answers every request with one fixed token; records each round it is given."""

    def __init__(self, inner=None):
        self.inner = inner
        self.rounds: list[list[SampleRequest]] = []

    def sample(self, prompt, num_samples=1, sampling_params=None, include_prompt_logprobs=False):
        [future] = self.sample_many([SampleRequest(prompt, num_samples, sampling_params)])
        return future

    def sample_many(self, requests, include_prompt_logprobs=False):
        self.rounds.append(list(requests))
        if self.inner is not None:
            return self.inner.sample_many(requests)
        return [APIFuture.completed(SampleResponse(sequences=[
            SampledSequence(tokens=[7], logprobs=[-1.0], stop_reason="length")] * r.num_samples))
            for r in requests]

    def compute_logprobs(self, prompt):
        raise NotImplementedError


def test_a_round_waits_for_every_live_episode_and_sorts_by_key():
    sampler = RecordingSampler()
    rounds = Rounds(sampler, live=3)
    order: list[str] = []

    async def episode(key: str, delay: int, turns: int) -> None:
        for _ in range(delay):
            await asyncio.sleep(0)  # other episodes run first
        for t in range(turns):
            await rounds.sample(key, SampleRequest([ord(key), t]), episodes=1)
            order.append(f"{key}{t}")
        rounds.retire()

    async def main() -> None:
        await asyncio.gather(episode("c", 0, 2), episode("a", 3, 1), episode("b", 1, 3))

    asyncio.run(main())
    # each round holds every live episode's request, sorted by key
    assert [[(r.prompt[0], r.prompt[1]) for r in round_] for round_ in sampler.rounds] == [
        [(97, 0), (98, 0), (99, 0)],  # a, b, c: turn 0, a asking last
        [(98, 1), (99, 1)],  # a retired
        [(98, 2)],  # c retired
    ]
    assert sorted(order) == ["a0", "b0", "b1", "b2", "c0", "c1"] and rounds.rounds == 3


def test_lockstep_groups_submit_one_round_per_turn():
    sampler = RecordingSampler()
    with LocalService(model="tiny", seed=0) as service:
        rollouts = Rollouts(sampler, service.tokenizer,
                            RolloutConfig(max_tokens=4, lockstep=True))
        one_turn = [gym.make("tests/Lengthy-v0", max_turns=1) for _ in range(3)]
        two_turns = [gym.make("tests/Lengthy-v0") for _ in range(2)]
        broken = [gym.make("tests/Lengthy-v0", raise_on_seed=5)]
        groups = asyncio.run(rollouts.run_groups(
            [(two_turns, 4, "g1"), (one_turn, 3, "g0"), (broken, 5, "g2")]))
    assert [len(g.trajectories) for g in groups] == [2, 3, 1]
    assert groups[2].trajectories[0].failed  # its step raised: it retired after turn 0
    # turn 0: one shared request per group (group id order); turn 1: g1's two episodes
    assert [[r.num_samples for r in round_] for round_ in sampler.rounds] == [[3, 2, 1], [1, 1]]


def test_lockstep_rollouts_give_the_same_bits_on_fresh_deterministic_engines():
    def run() -> list[tuple[list[int], list[float]]]:
        with LocalService(model="tiny", seed=0, deterministic=True) as service:
            rollouts = Rollouts(service.create_sampling_client(), service.tokenizer,
                                RolloutConfig(max_tokens=6, lockstep=True))
            specs = [([gym.make("tests/Lengthy-v0") for _ in range(3)], seed, f"g{seed}")
                     for seed in range(4)]
            groups = asyncio.run(rollouts.run_groups(specs))
        return [(t.tokens, t.logprobs) for g in groups for t in g.trajectories]

    first, second = run(), run()
    assert len(first) == 12 and all(lp for _, lp in first)
    assert first == second
