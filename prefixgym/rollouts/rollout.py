"""Drive agent envs against a sampler: one episode, a group, many groups at once.

An episode (`episode.Episode`): reset the env, start a `Conversation` with its system
prompt and tools, then observe, sample, step, until the env ends it or a turn or token
budget does; its `Trajectory` is written when it ends.
A group: G envs reset with one seed share their first prompt, so the first turn's G
replies come from one `sample(num_samples=G)` request (one prefill); later turns
run concurrently. Many groups run at once under asyncio (`run_groups`), so the engine
batches them: as they come (free-running), or, with `RolloutConfig.lockstep`, in
rounds of every live episode's next request in a fixed order (`rounds.py`), so that a
deterministic engine batches them the same way every run.

The rollout knows envs (text), conversations (tokens) and the sampling protocol; it
does not know which engine serves the samples.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from transformers import PreTrainedTokenizerBase

from prefixgym.protocols import SamplingClient
from prefixgym.rollouts.episode import AgentGymEnv, Episode
from prefixgym.rollouts.rounds import Rounds
from prefixgym.rollouts.types import Trajectory, TrajectoryGroup
from prefixgym.types import (
    JSONObject,
    ModelInput,
    SampledSequence,
    SampleRequest,
    SampleResponse,
    SamplingParams,
    Usage,
    derived_seed,
)

GroupSpec = tuple[Sequence[AgentGymEnv], int, str]
"""One group to run: its G envs, the seed they are all reset with, its group id."""


@dataclass
class RolloutConfig:
    max_tokens: int = 24
    """Tokens one assistant turn may sample."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    max_turns: int = 16
    """Assistant turns per episode at most (the env may end it sooner)."""
    max_episode_tokens: int = 1536
    """The episode's conversation may not grow past this many tokens."""
    lockstep: bool = False
    """Submit the next request of every live episode together, as one round ordered by
    episode id (`rounds.py`): the engine's batches then do not depend on timing."""


class TraceWriter:
    """Writes one JSONL line per sampling request (the trace format of docs/files.md);
    safe to share between threads (an async run samples and evaluates at once)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(
        self, episode_ids: Sequence[str], group_id: str, turn: int, prompt: ModelInput,
        num_samples: int, response: SampleResponse,
    ) -> None:
        record = {
            "episode_id": episode_ids[0] if len(episode_ids) == 1 else list(episode_ids),
            "group_id": group_id,
            "turn": turn,
            "prompt_tokens": prompt.tokens,
            "completion_tokens": [s.tokens for s in response.sequences],
            "num_samples": num_samples,
            "include_prompt_logprobs": False,
            "usage": response.usage.model_dump(),
        }
        self._write(record)

    def write_logprobs(self, prompt: ModelInput) -> None:
        """A `compute_logprobs` request: every position computed, none read from the cache."""
        usage = Usage(prefill_computed_tokens=prompt.length)
        self._write({"prompt_tokens": prompt.tokens, "num_samples": 1,
                     "include_prompt_logprobs": True, "usage": usage.model_dump()})

    def _write(self, record: JSONObject) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            self._stream.write(line)


class Rollouts:
    """Runs groups of episodes of one env id against a sampling client."""

    def __init__(
        self, sampler: SamplingClient, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig,
        trace: TraceWriter | None = None,
    ) -> None:
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.config = config
        self.trace = trace

    def params(self, seed: int | None) -> SamplingParams:
        c = self.config
        return SamplingParams(
            max_tokens=c.max_tokens, temperature=c.temperature, top_p=c.top_p, seed=seed
        )

    async def run_groups(self, groups: Sequence[GroupSpec]) -> list[TrajectoryGroup]:
        """Many groups at once; in lockstep, their requests share rounds."""
        run = _Run(self, sum(len(envs) for envs, _, _ in groups))
        return list(await asyncio.gather(*(run.group(*spec) for spec in groups)))

    async def run_group(
        self, envs: Sequence[AgentGymEnv], seed: int, group_id: str
    ) -> TrajectoryGroup:
        """1) reset G envs with one seed; 2) one G-sample first turn; 3) the rest concurrently."""
        return await _Run(self, len(envs)).group(envs, seed, group_id)


class _Run:
    """One call's groups, and in lockstep the rounds their requests share: each episode
    retires from them when it finishes (`Episode.on_finish`), whatever ends it."""

    def __init__(self, rollouts: Rollouts, episodes: int) -> None:
        self.r = rollouts
        self.config = rollouts.config
        self.rounds = Rounds(rollouts.sampler, episodes) if self.config.lockstep else None

    async def group(
        self, envs: Sequence[AgentGymEnv], seed: int, group_id: str
    ) -> TrajectoryGroup:
        trajectories = [Trajectory(episode_id=f"{group_id}/{i}", group_id=group_id, seed=seed)
                        for i in range(len(envs))]
        retire = self.rounds.retire if self.rounds is not None else None
        episodes = [Episode(env, self.r.tokenizer, traj, on_finish=retire)
                    for env, traj in zip(envs, trajectories)]
        reset = await asyncio.gather(*(ep.reset(seed) for ep in episodes))  # together
        episodes = [ep for ep, ok in zip(episodes, reset) if ok]
        if not episodes:
            return TrajectoryGroup(group_id, seed, trajectories)
        # 1) the G prompts are equal when the env is deterministic under its seed
        prompts = [ep.conv.generation_prompt() for ep in episodes]
        # 2) one request, one prefill, G samples
        if all(p.tokens == prompts[0].tokens for p in prompts):
            firsts = await self.sample(episodes, prompts[0], 0, seed)
        else:
            firsts = [s for [s] in await asyncio.gather(*(
                self.sample([ep], p, 0, derived_seed(seed, i))
                for i, (ep, p) in enumerate(zip(episodes, prompts))
            ))]
        # 3) each episode goes on by itself; the engine batches them
        await asyncio.gather(*(self.play(ep, firsts[i], derived_seed(seed, i))
                               for i, ep in enumerate(episodes)))
        return TrajectoryGroup(group_id, seed, trajectories)

    async def sample(
        self, episodes: Sequence[Episode], prompt: ModelInput, turn: int, seed: int,
    ) -> list[_Sample]:
        g = len(episodes)
        params = self.r.params(seed)
        if self.rounds is None:
            response = await self.r.sampler.sample(prompt, num_samples=g, sampling_params=params)
        else:
            request = SampleRequest(prompt, g, params)
            response = await self.rounds.sample(episodes[0].traj.episode_id, request, episodes=g)
        if self.r.trace is not None:
            ids = [ep.traj.episode_id for ep in episodes]
            self.r.trace.write(ids, episodes[0].traj.group_id, turn, prompt, g, response)
        # a shared request's usage goes to the first episode only
        return [_Sample(seq, response.usage if i == 0 else Usage(), g, response.weights_version)
                for i, seq in enumerate(response.sequences)]

    async def play(self, ep: Episode, first: _Sample, seed: int) -> None:
        """Observe, sample, step, until the env or a budget ends the episode."""
        sample, n = first, 0
        while True:
            seq = sample.sequence
            turn = ep.add_reply(seq.tokens, seq.logprobs, seq.stop_reason, sample.usage,
                                sample.shared_by)
            turn.weights_version = sample.weights_version
            n += 1
            if not await ep.step(turn):
                return
            prompt = ep.conv.generation_prompt()
            if n >= self.config.max_turns:
                return ep.end("max_turns")
            if prompt.length + self.config.max_tokens > self.config.max_episode_tokens:
                return ep.end("max_episode_tokens")
            [sample] = await self.sample([ep], prompt, n, derived_seed(seed, 1000 + n))


@dataclass
class _Sample:
    """One sampled sequence, the usage it carries, and how many episodes its request served."""

    sequence: SampledSequence
    usage: Usage
    shared_by: int
    weights_version: str | None = None
