"""One episode in the making: an env, its `Conversation`, and the trajectory it records.

Whatever picks the replies -- a sampler (`rollout.py`) or the env's scripted expert
(`expert.py`) -- an episode goes the same way:
  1) `Episode(env, ...)` starts the conversation with the env's system prompt and
     tools; `await reset(seed)` resets the env and appends what it says (after the
     system prompt the env has then: it may set one per task);
  2) `add_reply(ids, logprobs, ...)` appends a reply's ids exactly as given and
     records its `Turn` (where the reply sits in the tokens);
  3) `await step(turn)` gives the env the reply's text and records its answer on the
     turn and the trajectory (reward, invalid reply, how it ended), appending the
     env's next message while the episode goes on;
  4) `finish(stop_reason)` writes the trajectory's aligned arrays -- tokens, sampled
     mask, logprobs -- once, from the conversation, and tells `on_finish`. Every way an
     episode ends goes through it: the env ends it, a budget does (`end`), or the env
     raises (ended as "env_error", never the run).

The env is reset and stepped through its wrappers (Gymnasium's TimeLimit,
RewardWrapper, ...), inline; an env that waits on I/O overrides `areset`/`astep`, and
is awaited there when it has no wrappers, or its wrapped `reset`/`step` run in a
worker thread when it has (wrappers are synchronous).

Knows envs (text), conversations (tokens) and the rollout types; not samplers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, SupportsFloat

import gymnasium as gym
from transformers import PreTrainedTokenizerBase

from prefixgym.envs.base import AgentEnv, Observation, agent_of
from prefixgym.prompting import Conversation
from prefixgym.rollouts.types import Trajectory, Turn
from prefixgym.types import StopReason, Usage

AgentGymEnv = gym.Env[Observation, str]
StepResult = tuple[Observation, SupportsFloat, bool, bool, dict[str, Any]]  # gymnasium's


class Episode:
    """One env + its conversation + the trajectory being recorded. `on_finish` is called
    once, when the episode ends (a lockstep rollout retires it from its rounds)."""

    def __init__(
        self, env: AgentGymEnv, tokenizer: PreTrainedTokenizerBase, trajectory: Trajectory,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self.env = env
        self.agent: AgentEnv = agent_of(env)
        system, tools = self.agent.prompt()
        self.conv = Conversation(tokenizer=tokenizer, system=system, tools=tools)
        self.traj = trajectory
        self.finished = False
        self._on_finish = on_finish
        self._logprobs: list[Sequence[float]] = []  # per turn, until finish()

    async def reset(self, seed: int | None) -> bool:
        """1) Reset the env with `seed` and append its first message. False when the env
        raised: the episode has then ended ("env_error")."""
        try:
            obs, _ = await self._call_env("reset", seed=seed)
        except Exception as e:  # an env that raises ends its episode, never the run
            self.finish("env_error", error=f"{type(e).__name__}: {e}")
            return False
        self.begin(obs)
        return True

    async def _call_env(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The env's `reset` or `step`, run as the env runs it best: its own async
        `a<name>`, the sync method in a worker thread when it overrides `a<name>`, else
        inline; the seconds it took go to the trajectory's `env_s`, raised or not."""
        start = time.perf_counter()
        try:
            if self._awaits(f"a{name}"):
                return await getattr(self.agent, f"a{name}")(*args, **kwargs)
            if self._overrides(f"a{name}"):
                return await asyncio.to_thread(getattr(self.env, name), *args, **kwargs)
            return getattr(self.env, name)(*args, **kwargs)
        finally:
            self.traj.env_s += time.perf_counter() - start

    def begin(self, observation: Observation) -> None:
        """Append the env's first message (what `reset` returned), after the system
        prompt and tools as they are now: an env may set them per task at reset."""
        system, tools = self.agent.prompt()
        if system != self.conv.system or list(tools) != self.conv.tools:
            self.conv = Conversation(tokenizer=self.conv.tokenizer, system=system, tools=tools)
        self.conv.add_messages(observation)

    def add_reply(
        self, tokens: Sequence[int], logprobs: Sequence[float], stop_reason: StopReason,
        usage: Usage | None = None, shared_by: int = 1,
    ) -> Turn:
        """2) Append a reply's ids verbatim (plus the closing the format needs)."""
        if len(logprobs) != len(tokens):
            raise ValueError(f"a reply of {len(tokens)} tokens came with {len(logprobs)} logprobs")
        self.conv.add_sampled(tokens, stop_reason=stop_reason)
        reply = next(s for s in reversed(self.conv.segments) if s.kind == "reply")
        turn = Turn(reply.start, reply.end, stop_reason, self.conv.last_reply_text,
                    usage=usage or Usage(), shared_by=shared_by)
        self.traj.turns.append(turn)
        self._logprobs.append(logprobs)
        return turn

    async def step(self, turn: Turn) -> bool:
        """3) The env's answer to `turn`'s reply, recorded; True while the episode goes on
        (the env's next message appended), False once it has ended."""
        try:
            result = await self._call_env("step", turn.reply_text)
        except Exception as e:  # an env that raises ends its episode, never the run
            self.finish("env_error", error=f"{type(e).__name__}: {e}")
            return False
        return self.record(turn, result)

    def record(self, turn: Turn, result: StepResult) -> bool:
        """The env's answer to `turn` (what `env.step` returned) on the turn and the
        trajectory; finishes the episode when the env ended it. True while it goes on."""
        obs, reward, terminated, truncated, info = result
        turn.reward = float(reward)
        turn.invalid_action = bool(info.get("invalid_action", False))
        if terminated or truncated:
            self.traj.terminated, self.traj.truncated = bool(terminated), bool(truncated)
            self.traj.is_success = bool(info.get("is_success", False))
            self.finish(str(info.get("stop_reason", "terminated" if terminated else "truncated")))
            return False
        self.conv.add_messages(obs)
        return True

    def end(self, stop_reason: str) -> None:
        """End an episode the env did not end: a turn or token budget ran out."""
        self.traj.truncated = True
        self.finish(stop_reason)

    def finish(self, stop_reason: str, error: str | None = None) -> None:
        """4) The trajectory's arrays, from the conversation, once."""
        if self.finished:
            raise RuntimeError(f"episode {self.traj.episode_id} has ended already")
        self.finished = True
        traj = self.traj
        traj.stop_reason = stop_reason
        traj.tokens = self.conv.tokens
        traj.sampled_mask = [False] * len(traj.tokens)
        traj.logprobs = [0.0] * len(traj.tokens)
        for turn, logprobs in zip(traj.turns, self._logprobs):
            traj.sampled_mask[turn.reply_start : turn.reply_end] = [True] * len(logprobs)
            traj.logprobs[turn.reply_start : turn.reply_end] = [float(x) for x in logprobs]
        traj.extension_ok = self.conv.extension_ok
        if error is not None:
            traj.failed, traj.error = True, error
        if self._on_finish is not None:
            self._on_finish()

    def _overrides(self, method: str) -> bool:
        """Whether the env's class replaces AgentEnv's `areset`/`astep` (it waits on I/O)."""
        return getattr(type(self.agent), method) is not getattr(AgentEnv, method)

    def _awaits(self, method: str) -> bool:
        """Await the env's own coroutine: it overrides `method` and has no wrappers."""
        return self._overrides(method) and self.env is self.agent
