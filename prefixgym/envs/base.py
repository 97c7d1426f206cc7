"""AgentEnv: a Gymnasium env whose actions are assistant replies and whose
observations are the messages the env sends back.

A new env overrides two methods and sets a system prompt:

    class Echo(AgentEnv):
        system_prompt = "Repeat the word."
        def _reset_task(self) -> str:                  # the first user message
            self.word = ["cat", "dog"][self.np_random.integers(2)]
            return f"Say {self.word}."
        def _act(self, text: str) -> Outcome:          # one reply without tool calls
            ok = text.strip() == self.word
            return Outcome("Right." if ok else "Wrong.", rewards={"success": float(ok)},
                           done=True, success=ok)

Everything else is handled here, identically for every env:
1. tool calls: a reply that contains `<tool_call>` blocks runs them (see
   `prompting.tools`) and each result comes back as a tool message, reward 0; an
   unparseable call is an invalid action, a failing tool an error tool message;
2. invalid actions (`Outcome(invalid=True)` or a bad tool call): the feedback
   message, `-invalid_penalty` and a counter; nothing is raised;
3. `max_turns` (assistant replies, tool turns included) truncates the episode;
4. the transcript, `render_mode="ansi"`, and `areset`/`astep` (reset/step in a
   thread pool).

Randomness comes only from `self.np_random`, so `reset(seed=s)` replays an episode.
`system_prompt` is read after each reset: `_reset_task` may set one per task (a
dataset row's); the samples of a GRPO group share it, as the cache's fixed prefix.
An env that holds a resource (a server session) frees it in `close()`, which every
run calls on every env it made; one that raises in reset or step ends its episode as
an env error, counted apart from failures.
Observation: a tuple of `{"role": "user" | "tool", "name": str, "content": str}`.
This module knows text only: nothing of tokens, models or chat formats.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

import gymnasium as gym

from prefixgym.envs.spaces import AnyText, messages_space
from prefixgym.prompting.tools import (
    Tool,
    ToolCall,
    ToolCallError,
    ToolLike,
    as_tools,
    parse_tool_calls,
    tools_json,
)

Message = dict[str, str]
Observation = tuple[Message, ...]


@dataclass
class Outcome:
    """The env's answer to one assistant reply that has no tool calls."""

    message: str
    """The next user message (may be "" when `done`)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward components; the step reward is their sum (minus any invalid penalty)."""
    done: bool = False
    """The task ended (the episode is terminated)."""
    success: bool = False
    """The task was solved (`info["is_success"]`)."""
    invalid: bool = False
    """The reply was malformed: the base adds `-invalid_penalty` and counts it."""
    stop_reason: str | None = None
    """Why the task ended; defaults to "success" or "failure"."""


class AgentEnv(gym.Env[Observation, str]):
    """Base class of the text envs; see the module docstring for the contract.

    Subclasses set `system_prompt` (and `tools`), and override `_reset_task`,
    `_act`, and for built-in envs `expert_action` and `_leak_probes`."""

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}
    system_prompt: str = ""
    reward_floor: float = 0.0
    """The most an episode of garbage replies may earn (checked by check_agent_env)."""
    full_return: float = 1.0
    """The least an expert episode earns (checked by check_agent_env)."""
    expert_noise: float = 0.0
    """The share of episodes (or replies) in which the expert errs on purpose, to leave
    GRPO something to learn; check_agent_env checks the expert with it set to 0."""

    def __init__(
        self,
        *,
        max_turns: int = 8,
        invalid_penalty: float = 0.1,
        tools: Sequence[ToolLike] | None = None,
        tool_schemas: bool = True,
        render_mode: str | None = None,
    ) -> None:
        if not isinstance(tool_schemas, bool):
            raise ValueError(f"tool_schemas must be true or false, got {tool_schemas!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        if not invalid_penalty >= 0:
            raise ValueError(f"invalid_penalty must be >= 0, got {invalid_penalty!r}")
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.max_turns = max_turns
        self.invalid_penalty = float(invalid_penalty)
        # a typed function or a pydantic model class becomes a Tool exactly as @tool makes it
        self.tools: list[Tool] = as_tools(tools)
        tools_json(self.tools)  # fails early on duplicate tool names
        self.tool_schemas = tool_schemas
        self.render_mode = render_mode
        self.observation_space = messages_space()
        self.action_space = AnyText()
        self._transcript: list[Message] = []
        self.reset_seed: int | None = None
        """The last reset's seed (None: none given), for an env whose task another
        library draws (`task_seed`)."""
        self._turn = 0
        self._done = True
        self._success = False
        self._counters: dict[str, int] = {}

    # --- the extension point -------------------------------------------------------

    def _reset_task(self) -> str:
        """Draw a new task with `self.np_random`; return the first user message."""
        raise NotImplementedError

    def _act(self, text: str) -> Outcome:
        """Answer one assistant reply that contains no tool calls."""
        raise NotImplementedError

    def task_seed(self) -> int:
        """The seed to draw a task of another library with: the reset's own (so the envs
        of a GRPO group, reset with one seed, draw one task), else one from `np_random`."""
        if self.reset_seed is not None:
            return self.reset_seed
        return int(self.np_random.integers(2**31))

    def expert_action(self) -> str:
        """A scripted, near-optimal next reply in the exact syntax the env expects."""
        raise NotImplementedError(f"{type(self).__name__} has no expert policy")

    def _leak_probes(self) -> list[str]:
        """Texts that reveal the hidden answer: no user message may contain one
        (as a whole word) before the episode ends."""
        return []

    def prompt(self) -> tuple[str, list[Tool]]:
        """The system text and the tools whose definitions the conversation's fixed
        prefix carries. With `tool_schemas` (the default) that is the system prompt and
        every tool, whose JSON schemas the chat format renders; without, the system
        prompt plus one line naming each tool and its arguments, and no schemas: a far
        shorter context for a small model trained from scratch, which learns the call
        syntax from the expert's episodes (the tools run the same either way)."""
        if self.tool_schemas or not self.tools:
            return self.system_prompt, list(self.tools)
        names = ", ".join(f"{t.name}({', '.join(t.schema()['parameters'].get('properties', {}))})"
                          for t in self.tools)
        return f"{self.system_prompt} Tools: {names}.".strip(), []

    # --- gymnasium API -----------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        super().reset(seed=seed)
        self.reset_seed = seed
        self._turn, self._done, self._success = 0, False, False
        self._counters = {"num_invalid_actions": 0, "num_tool_calls": 0, "num_tool_errors": 0}
        first = self._reset_task()
        if not isinstance(first, str):
            raise TypeError(f"{type(self).__name__}._reset_task must return str")
        self._transcript = []
        obs = self._emit([{"role": "user", "name": "", "content": first}])
        return obs, self._info("running", False, {})

    def step(
        self, action: str
    ) -> tuple[Observation, SupportsFloat, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise ValueError(f"action must be str (the assistant reply), got {type(action)}")
        if self._done:
            raise RuntimeError("the episode is over: call reset() before step()")
        self._turn += 1
        self._transcript.append({"role": "assistant", "name": "", "content": action})
        calls = parse_tool_calls(action, self.tools) if "<tool_call>" in action else []
        if calls:
            messages, invalid = self._run_tools(calls)
            outcome = Outcome("", invalid=invalid)
        else:
            outcome = self._act(action)
            messages = [{"role": "user", "name": "", "content": outcome.message}]
        rewards = dict(outcome.rewards)
        if outcome.invalid:
            self._counters["num_invalid_actions"] += 1
            rewards["invalid"] = rewards.get("invalid", 0.0) - self.invalid_penalty
        terminated = outcome.done
        truncated = not terminated and self._turn >= self.max_turns
        self._done = terminated or truncated
        self._success = terminated and outcome.success
        if terminated:
            stop_reason = outcome.stop_reason or ("success" if outcome.success else "failure")
        else:
            stop_reason = "max_turns" if truncated else "running"
        obs = self._emit([m for m in messages if m["content"] or m["role"] == "tool"])
        info = self._info(stop_reason, outcome.invalid, rewards)
        return obs, float(sum(rewards.values())), terminated, truncated, info

    def render(self) -> str | None:  # type: ignore[override]
        if self.render_mode != "ansi":
            return None
        return self.transcript_text()

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        """`reset` in the default thread pool, so that many envs can be awaited at once."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, functools.partial(self.reset, seed=seed, options=options)
        )

    async def astep(
        self, action: str
    ) -> tuple[Observation, SupportsFloat, bool, bool, dict[str, Any]]:
        """`step` in the default thread pool."""
        return await asyncio.get_running_loop().run_in_executor(None, self.step, action)

    # --- transcript ---------------------------------------------------------------------

    @property
    def turn(self) -> int:
        """Assistant replies so far in this episode."""
        return self._turn

    @property
    def transcript(self) -> list[Message]:
        """Every message of the episode (user, assistant, tool), as copies."""
        return [dict(m) for m in self._transcript]

    def transcript_text(self) -> str:
        """The system prompt, tool names and the episode, as readable text."""
        parts = [f"[system]\n{self.system_prompt}"]
        if self.tools:
            parts.append("[tools] " + ", ".join(t.name for t in self.tools))
        for m in self._transcript:
            header = f"[{m['role']} {m['name']}]" if m["name"] else f"[{m['role']}]"
            parts.append(f"{header}\n{m['content']}")
        return "\n\n".join(parts) + "\n"

    # --- internals -----------------------------------------------------------------------

    def _run_tools(self, calls: list[ToolCall | ToolCallError]) -> tuple[list[Message], bool]:
        by_name = {t.name: t for t in self.tools}
        messages: list[Message] = []
        invalid = False
        for call in calls:
            self._counters["num_tool_calls"] += 1
            if isinstance(call, ToolCallError):
                invalid = True
                self._counters["num_tool_errors"] += 1
                content = f"Error: {call.message}"
                messages.append({"role": "tool", "name": call.name or "", "content": content})
                continue
            content, ok = by_name[call.name].call_with_status(call.arguments)
            if not ok:
                self._counters["num_tool_errors"] += 1
            messages.append({"role": "tool", "name": call.name, "content": content})
        return messages, invalid

    def _emit(self, messages: list[Message]) -> Observation:
        self._transcript.extend(dict(m) for m in messages)
        return tuple(dict(m) for m in messages)

    def _info(self, stop_reason: str, invalid: bool, rewards: dict[str, float]) -> dict[str, Any]:
        return {
            "turn": self._turn,
            "stop_reason": stop_reason,
            "invalid_action": invalid,
            "reward_components": dict(rewards),
            "is_success": self._success,
            **self._counters,
        }


def share(name: str, value: object) -> float:
    """`value` as a float in 0..1 (an env's share of episodes, e.g. an expert's noise);
    ValueError naming `name` for anything else (bools and strings included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in 0..1, got {value!r}")
    return float(value)


def has_expert(env: gym.Env[Observation, str]) -> bool:
    """Whether the env (under its wrappers) plays a scripted expert: its class overrides
    `expert_action`, which the warm start's episodes are made of (an adapter whose games
    differ says per instance, in `expert_available`)."""
    agent = agent_of(env)
    available = getattr(agent, "expert_available", None)
    if available is not None:
        return bool(available)
    return type(agent).expert_action is not AgentEnv.expert_action


def replays_its_seed(env: gym.Env[Observation, str], seed: int = 0) -> bool:
    """Whether two resets with one seed give the same first observation: what a GRPO
    group needs (its G envs are reset with one seed and must pose one task)."""
    first, _ = env.reset(seed=seed)
    again, _ = env.reset(seed=seed)
    return first == again


def agent_of(env: gym.Env[Observation, str]) -> AgentEnv:
    """The `AgentEnv` under an env's wrappers; ValueError for an env that is not one."""
    agent = env.unwrapped
    if not isinstance(agent, AgentEnv):
        spec = getattr(env, "spec", None)
        name = spec.id if spec is not None else type(agent).__name__
        raise ValueError(
            f"env {name} is not a prefixgym AgentEnv: rollouts need text actions, a "
            "system_prompt and tools (subclass prefixgym.envs.AgentEnv)"
        )
    return agent
