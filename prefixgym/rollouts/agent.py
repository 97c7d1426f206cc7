"""Agent rollouts: a user's program over OpenAI's API, run G times per task, trained on.

An agent program is a function, sync or async, called with the keyword arguments
`base_url`, `api_key`, `model` and `task` (it may declare only those it uses); it talks
to the model through `base_url` with any OpenAI client or agent framework and returns its
reward: a number, or a dict of named numbers (summed with `AgentConfig.reward_weights`,
1 for a name it does not give). A rollout succeeded when its `success` component, or
without one its reward, is above 0. How a program is loaded, called and read back is
`agent_program.py`.

A group: G rollouts of one task, at once (`AgentRollouts.run_groups`). Each rollout:
  1) opens a base URL of its own on the gateway, backed by a fresh `CallTree` (nothing
     passes between rollouts);
  2) runs the program against it, within `timeout_s`;
  3) closes the URL, and turns the tree into its `Trajectory`: the sequence its last
     call ended, plus the branches its program made by rewriting history
     (`Trajectory.branches`, trained with the same advantage; a reply shared by two
     sequences is trained once). The reward goes on the last turn.
A program that raises, times out, returns no number, or sent a call the gateway refused
(another model's name) fails its rollout with one line (`Trajectory.error`); training
goes on without it. Many groups run at once, in waves of `max_concurrent` rollouts; in
lockstep (the default) each wave's calls are sampled in rounds (`agent_rounds.py`), so
that the engine's batches do not depend on timing. With a `TraceWriter` (`--trace`),
every call goes to the trace as an env's turn does: its rollout's episode and group ids,
its call number as the turn.

Knows the gateway and sampling protocols, call trees and trajectories; not HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixgym.futures import APIFuture
from prefixgym.prompting.call_tree import FORCED_CALL_MISSED, Branch, CallTree, TrainedSequence
from prefixgym.protocols import AgentGateway, SamplingClient
from prefixgym.rollouts.agent_program import (
    AgentProgram,
    AgentTask,
    EnvTasks,
    load_agent,
    reward_of,
)
from prefixgym.rollouts.agent_rounds import AgentRounds
from prefixgym.rollouts.rollout import TraceWriter
from prefixgym.rollouts.types import Trajectory, TrajectoryGroup, Turn
from prefixgym.types import (
    JSONObject,
    ModelInput,
    SampleResponse,
    SamplingParams,
    Usage,
    derived_seed,
)

__all__ = [  # the program's contract is agent_program.py's, imported from here too
    "AgentConfig",
    "AgentProgram",
    "AgentRollouts",
    "AgentTask",
    "EnvTasks",
    "load_agent",
    "record",
    "reward_of",
]


@dataclass
class AgentConfig:
    timeout_s: float = 300.0
    """Seconds a program may take for one rollout before it is counted as failed."""
    max_concurrent: int = 128
    """Programs running at once: rollouts go in waves of this many, in order."""
    lockstep: bool = True
    """Hold each call until every rollout of its wave has called or returned, then sample
    them as one round in a fixed order (`agent_rounds.py`): the engine's batches, and so
    the run, do not depend on timing."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """Weights of a dict reward's named components (1 for those not named)."""


class AgentRollouts:
    """Runs groups of an agent program's rollouts against a gateway (module docstring)."""

    def __init__(self, program: AgentProgram, gateway: AgentGateway,
                 make_tree: Callable[[], CallTree], model: str, config: AgentConfig) -> None:
        self.program = program
        self.gateway = gateway
        self.make_tree = make_tree
        self.model = model
        self.config = config

    async def run_groups(self, sampler: SamplingClient,
                         groups: Sequence[tuple[AgentTask, int, str]], group_size: int,
                         temperature: float | None = None,
                         on_rollout: Callable[[Trajectory], None] | None = None,
                         trace: TraceWriter | None = None) -> list[TrajectoryGroup]:
        """Each (task, seed, group id) run `group_size` times: the rollouts in waves of
        `max_concurrent`, in order; in lockstep, each wave's calls in rounds.
        `on_rollout(trajectory)` is told of each rollout as it ends; `trace` gets every
        call."""
        out = [TrajectoryGroup(gid, seed, [
            Trajectory(episode_id=f"{gid}/{i}", group_id=gid, seed=seed)
            for i in range(group_size)]) for _, seed, gid in groups]
        runs = [(task, derived_seed(seed, i), traj) for (task, seed, _), group in zip(groups, out)
                for i, traj in enumerate(group.trajectories)]
        width = self.config.max_concurrent
        for start in range(0, len(runs), width):
            wave = runs[start:start + width]
            rounds = AgentRounds(sampler, len(wave)) if self.config.lockstep else None
            await asyncio.gather(*(self.rollout(sampler, task, seed, traj, temperature, rounds,
                                                on_rollout, trace) for task, seed, traj in wave))
        return out

    async def rollout(self, sampler: SamplingClient, task: AgentTask, seed: int,
                      traj: Trajectory, temperature: float | None = None,
                      rounds: AgentRounds | None = None,
                      on_rollout: Callable[[Trajectory], None] | None = None,
                      trace: TraceWriter | None = None) -> None:
        """Steps 1-3 for one rollout, recorded on `traj`."""
        tree = self.make_tree()
        key = traj.episode_id.replace("/", ".")
        # 1) a base URL of its own (in lockstep, its calls join the wave's rounds)
        calls = rounds.client(key) if rounds is not None else sampler
        if trace is not None:
            calls = _TracedCalls(calls, trace, traj)
        base_url = self.gateway.open(key, tree, calls, seed, temperature)
        error, reward, components = None, 0.0, dict[str, float]()
        start = time.perf_counter()
        # 2) the program
        limit = asyncio.timeout(self.config.timeout_s)
        try:
            async with limit:
                result = await self.program(base_url=base_url,
                                            api_key=self.gateway.api_key or "none",
                                            model=self.model, task=task)
        except Exception as e:  # noqa: BLE001 - a program's failure fails its rollout
            error = (f"the program did not return within {self.config.timeout_s:g} s"
                     if limit.expired() else
                     f"the program raised {type(e).__name__}: {_first_line(e)}")
        else:
            try:
                reward, components = reward_of(result, self.config.reward_weights)
            except ValueError as e:  # no number
                error = str(e)
        finally:
            refused = self.gateway.close(key)
            if rounds is not None:
                rounds.retire()
        traj.env_s = time.perf_counter() - start
        if error is None and refused:
            error = f"a call was refused: {refused[0]}"
        # 3) the trajectory
        record(traj, tree.sequences(), reward, components, tree.branches)
        if error is None and not traj.turns:
            error = "the program made no call to its base_url"
        if error is not None:
            traj.failed, traj.error = True, error
        traj.is_success = error is None and components.get("success", reward) > 0
        traj.stop_reason = "agent_error" if error is not None else "agent_returned"
        if on_rollout is not None:
            on_rollout(traj)


class _TracedCalls:
    """A rollout's sampler that also writes each of its calls to the run's trace."""

    def __init__(self, inner: SamplingClient, trace: TraceWriter, traj: Trajectory) -> None:
        self._inner, self._trace, self._traj = inner, trace, traj
        self._calls = itertools.count()

    def sample(self, prompt: ModelInput | list[int], num_samples: int = 1,
               sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False) -> APIFuture[SampleResponse]:
        model_input = prompt if isinstance(prompt, ModelInput) else ModelInput.from_ints(prompt)
        turn = next(self._calls)
        future = self._inner.sample(model_input, num_samples, sampling_params,
                                    include_prompt_logprobs)

        def write(done: concurrent.futures.Future[SampleResponse]) -> None:
            if done.exception() is None:
                self._trace.write([self._traj.episode_id], self._traj.group_id, turn,
                                  model_input, num_samples, done.result())

        future.future().add_done_callback(write)
        return future

    def compute_logprobs(self, prompt: ModelInput | list[int]) -> APIFuture[list[float | None]]:
        model_input = prompt if isinstance(prompt, ModelInput) else ModelInput.from_ints(prompt)
        self._trace.write_logprobs(model_input)
        return self._inner.compute_logprobs(prompt)


def record(traj: Trajectory, sequences: Sequence[TrainedSequence], reward: float,
           components: dict[str, float], branches: Sequence[Branch]) -> None:
    """Fill `traj` from a rollout's sequences: the last is the trajectory itself, the
    others its branches. Each reply's usage is counted once, and each reply is trained
    in the first sequence that holds it (the last sequence first)."""
    if not sequences:
        return
    seen: set[int] = set()
    built: list[Trajectory] = []
    for seq in [sequences[-1], *sequences[:-1]]:
        target = traj if not built else Trajectory(
            episode_id=f"{traj.episode_id}#{len(built)}", group_id=traj.group_id, seed=traj.seed)
        _fill(target, seq, seen)
        target.turns[-1].reward = reward
        built.append(target)
    traj.branches = built[1:]
    traj.reward_components = components
    traj.branch_notes = [b.line() for b in branches]
    traj.branch_reprefilled_tokens = sum(b.reprefilled_tokens for b in branches)
    traj.terminated = True


def _fill(traj: Trajectory, seq: TrainedSequence, seen: set[int]) -> None:
    mask = list(seq.sampled_mask)
    for reply in seq.replies:
        first = id(reply) not in seen
        seen.add(id(reply))
        info: JSONObject = reply.info
        usage = Usage(**info["usage"]) if first and info.get("usage") else Usage()
        traj.turns.append(Turn(reply.start, reply.end, reply.stop_reason, reply.text,
                               usage=usage, shared_by=int(info.get("shared_by", 1)),
                               weights_version=info.get("weights_version"),
                               invalid_action=bool(info.get(FORCED_CALL_MISSED))))
        if not first:
            mask[reply.start:reply.end] = [False] * (reply.end - reply.start)
    traj.tokens, traj.sampled_mask, traj.logprobs = seq.tokens, mask, seq.logprobs
    traj.extension_ok = seq.extension_ok


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
