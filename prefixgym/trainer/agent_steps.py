"""GRPO's step 1 and evaluation when the rollouts are an agent program's, not an env's.

`AgentSource` is what `prefixgym train --agent` hands the run: the program's rollouts
(`rollouts.agent`), the training tasks and the held-out ones. A step's B groups take B
tasks in an order fixed by the run's seed (a pass over the tasks, then another in the
same order), each group one task run G times, seeded as env groups are (`step_seeds`),
so a resumed run samples the same tasks. Evaluation runs each of the first N held-out
tasks once, at the evaluation temperature; success is a reward above 0.

Knows rollouts, tasks and the sampling protocol; not how programs reach the model.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixgym.protocols import SamplingClient
from prefixgym.rollouts.agent import AgentRollouts, AgentTask
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.evaluate import EVAL_SEED_BASE, EvalResult, summarize
from prefixgym.trainer.grpo import Collected, step_seeds


@dataclass
class AgentSource:
    rollouts: AgentRollouts
    tasks: Sequence[AgentTask]
    eval_tasks: Sequence[AgentTask]
    close: Callable[[], None] = lambda: None
    """Called when the run ends (stops the gateway the rollouts go through)."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("an agent run needs at least one task")
        self.eval_tasks = self.eval_tasks or self.tasks


def read_tasks(path: str, flag: str = "--tasks") -> list[AgentTask]:
    """One JSON value a line of a JSONL file (blank lines skipped); ValueError naming
    the line that is not JSON, or a file with no task."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    tasks = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            tasks.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {path}:{number}: not JSON ({e.msg})") from None
    if not tasks:
        raise ValueError(f"{flag} {path}: no task in the file")
    return tasks


def step_tasks(source: AgentSource, config: TrainConfig, step: int) -> list[AgentTask]:
    """The B tasks of GRPO step `step`: passes over the tasks in one seeded order."""
    order = list(range(len(source.tasks)))
    random.Random(config.seed).shuffle(order)
    b = config.groups_per_step
    return [source.tasks[order[(step * b + i) % len(order)]] for i in range(b)]


def collect_agent(source: AgentSource, sampler: SamplingClient, config: TrainConfig,
                  step: int, rank: int = 0, world: int = 1) -> Collected:
    """Step 1 with an agent program: B groups of G rollouts (this rank's share)."""
    start = time.perf_counter()
    tasks = step_tasks(source, config, step)
    groups = [(task, seed, f"step{step}.g{i}")
              for i, (task, seed) in enumerate(zip(tasks, step_seeds(config, step)))
              if i % world == rank]
    collected = asyncio.run(source.rollouts.run_groups(sampler, groups, config.group_size))
    return collected, time.perf_counter() - start


def evaluate_agent(source: AgentSource, sampler: SamplingClient, episodes: int,
                   temperature: float, name: str = "eval") -> EvalResult:
    """The first `episodes` held-out tasks, once each, at `temperature`."""
    tasks = list(source.eval_tasks)[:episodes]
    groups = [(task, EVAL_SEED_BASE + i, f"{name}.{i}") for i, task in enumerate(tasks)]
    collected = asyncio.run(source.rollouts.run_groups(sampler, groups, 1, temperature))
    return summarize([t for g in collected for t in g.trajectories])
