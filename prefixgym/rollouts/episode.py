"""One episode in the making: an env, its `Conversation`, and the trajectory it records.

Whatever picks the replies -- a sampler (`rollout.py`) or the env's scripted expert
(`expert.py`) -- an episode goes the same way:
  1) `Episode(env, ...)` starts the conversation with the env's system prompt and
     tools; `observe(obs)` appends what the env says;
  2) `add_reply(ids, logprobs, ...)` appends a reply's ids exactly as given and
     records its `Turn` (where the reply sits in the tokens);
  3) `finish(stop_reason)` writes the trajectory's aligned arrays -- tokens, sampled
     mask, logprobs -- once, from the conversation.

Knows envs (text), conversations (tokens) and the rollout types; not samplers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, SupportsFloat

import gymnasium as gym
from transformers import PreTrainedTokenizerBase

from prefixgym.envs.base import AgentEnv, Observation, agent_of
from prefixgym.prompting import Conversation
from prefixgym.rollouts.types import Trajectory, Turn
from prefixgym.types import StopReason, Usage

AgentGymEnv = gym.Env[Observation, str]
StepResult = tuple[Observation, SupportsFloat, bool, bool, dict[str, Any]]  # gymnasium's info


class Episode:
    """One env + its conversation + the trajectory being recorded."""

    def __init__(
        self, env: AgentGymEnv, tokenizer: PreTrainedTokenizerBase, trajectory: Trajectory
    ) -> None:
        self.env = env
        self.agent: AgentEnv = agent_of(env)
        system, tools = self.agent.prompt()
        self.conv = Conversation(tokenizer=tokenizer, system=system, tools=tools)
        self.traj = trajectory
        self.done = False
        self._logprobs: list[Sequence[float]] = []  # per turn, until finish()

    def observe(self, observation: Observation) -> None:
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

    def step(self, text: str) -> StepResult:
        return self.env.step(text)

    async def astep(self, text: str) -> StepResult:
        """`env.step`, awaited where the env overrides `astep` (an env that waits on I/O)."""
        if type(self.agent).astep is not AgentEnv.astep:
            return await self.agent.astep(text)
        return self.env.step(text)

    def finish(self, stop_reason: str, error: str | None = None) -> None:
        """3) The trajectory's arrays, from the conversation, once."""
        self.done = True
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
