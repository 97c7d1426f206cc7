"""Where a run's episodes come from when it trains an agent program (`--agent`).

`AgentSource` answers the calls `trainer.env_source.EnvSource` answers for envs: GRPO's
step 1, evaluation, closing. A step's B groups take B tasks in an order fixed by the
run's seed (a pass over the tasks, then another in the same order), each group one task
run G times, seeded as env groups are (`step_seeds`), so a resumed run samples the same
tasks. Evaluation runs each of the first N held-out tasks once, at the evaluation
temperature; success is the program's `success` component, or its reward, above 0.

Knows rollouts, tasks and the sampling protocol; not how programs reach the model.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixgym.files import read_jsonl
from prefixgym.protocols import SamplingClient
from prefixgym.rollouts.agent import AgentRollouts, AgentTask
from prefixgym.rollouts.rollout import TraceWriter
from prefixgym.rollouts.types import Trajectory
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.evaluate import EVAL_SEED_BASE, EvalResult, summarize
from prefixgym.trainer.grpo import Collected, step_seeds
from prefixgym.trainer.progress import Progress


@dataclass
class AgentSource:
    """A run's agent rollouts, its tasks and held-out tasks (the first tasks without)."""

    config: TrainConfig
    rollouts: AgentRollouts
    tasks: Sequence[AgentTask]
    eval_tasks: Sequence[AgentTask]
    on_close: Callable[[], None] = lambda: None
    """Called when the run ends (stops the gateway the rollouts go through)."""
    task_of_seed: Callable[[int], AgentTask] | None = None
    """Tasks by seed (an env's reset, `--tasks env`) in place of the lists: a group's task
    is its seed's, an evaluation's the held-out seeds'."""

    def __post_init__(self) -> None:
        if not self.tasks and self.task_of_seed is None:
            raise ValueError("an agent run needs at least one task")
        self.eval_tasks = self.eval_tasks or self.tasks
        self._order = list(range(len(self.tasks)))  # the tasks' one seeded order
        random.Random(self.config.seed).shuffle(self._order)

    def step_tasks(self, step: int) -> list[AgentTask]:
        """The B tasks of GRPO step `step`: passes over the tasks in one seeded order."""
        b = self.config.groups_per_step
        return [self.tasks[self._order[(step * b + i) % len(self._order)]] for i in range(b)]

    def collect(self, sampler: SamplingClient, step: int, rank: int = 0, world: int = 1,
                trace: TraceWriter | None = None) -> Collected:
        """Step 1: B groups of G rollouts (this rank's share), and the seconds it took."""
        start = time.perf_counter()
        seeds = step_seeds(self.config, step)
        tasks = ([self.task_of_seed(s) for s in seeds] if self.task_of_seed is not None
                 else self.step_tasks(step))
        groups = [(task, seed, f"step{step}.g{i}")
                  for i, (task, seed) in enumerate(zip(tasks, seeds)) if i % world == rank]
        collected = asyncio.run(self.rollouts.run_groups(sampler, groups,
                                                         self.config.group_size, trace=trace))
        return collected, time.perf_counter() - start

    def evaluate(self, sampler: SamplingClient, temperature: float, when: str, name: str,
                 trace: TraceWriter | None = None) -> EvalResult:
        """The first `eval_episodes` held-out tasks, once each, at `temperature`."""
        n = self.config.eval_episodes
        tasks = ([self.task_of_seed(EVAL_SEED_BASE + i) for i in range(n)]
                 if self.task_of_seed is not None and not self.eval_tasks
                 else list(self.eval_tasks)[:n])
        groups = [(task, EVAL_SEED_BASE + i, f"{name}.{i}") for i, task in enumerate(tasks)]
        with Progress(f"eval ({when})", len(tasks), "task", self.config.progress) as progress:
            def done(_: Trajectory) -> None:
                progress.update(1)

            collected = asyncio.run(self.rollouts.run_groups(sampler, groups, 1, temperature,
                                                             on_rollout=done, trace=trace))
        return summarize([t for g in collected for t in g.trajectories])

    def close(self) -> None:
        self.on_close()


def read_tasks(path: str, flag: str = "--tasks") -> list[AgentTask]:
    """One JSON value a line of a JSONL file (blank lines skipped); ValueError naming
    the line that is not JSON, or a file with no task."""
    tasks = [value for _, value in read_jsonl(path, flag)]
    if not tasks:
        raise ValueError(f"{flag} {path}: no task in the file")
    return tasks
