"""`prefixgym train --agent`: the gateway its program calls and the rollouts it runs.

Builds, from the run's config and the tokenizer of the model it trains, what the run
needs in place of envs: an `AgentGateway` (a loopback OpenAI endpoint per rollout,
keyed by a fresh token), the program loaded from `--agent`, a `CallTree` per rollout in
the model's own chat format and tool-call syntax, and the tasks of `--tasks` and
`--eval-tasks`. Knows commands' inputs; the parts it builds know the rest.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from prefixgym.prompting.call_tree import CallTree
from prefixgym.prompting.conversation import chat_format_for
from prefixgym.rollouts.agent import (
    AgentConfig,
    AgentProgram,
    AgentRollouts,
    AgentTask,
    EnvTasks,
    load_agent,
)
from prefixgym.serving.agent_gateway import AgentGateway
from prefixgym.serving.agent_session import SamplingDefaults
from prefixgym.trainer.agent_steps import AgentSource, read_tasks
from prefixgym.trainer.config import TrainConfig

ENV_TASKS = "env"
"""`--tasks env`: the tasks --env's reset poses, one per group seed."""


@dataclass
class AgentInputs:
    """What the Python API may hand `train` instead of `--agent` and the task files: the
    program itself, and the tasks as any iterable of JSON-like values."""

    program: Callable[..., Any] | None = None
    tasks: Iterable[AgentTask] | None = None
    eval_tasks: Iterable[AgentTask] | None = None

    def __post_init__(self) -> None:  # a generator is read once, here
        if self.tasks is not None:
            self.tasks = list(self.tasks)
        if self.eval_tasks is not None:
            self.eval_tasks = list(self.eval_tasks)

    def resolve(self, config: TrainConfig) -> tuple[AgentProgram, list[AgentTask],
                                                     list[AgentTask]]:
        """The program and tasks of the run (ValueError, in one line, for bad ones)."""
        program = (AgentProgram(self.program, config.agent) if self.program is not None
                   else load_agent(config.agent))
        if self.tasks is not None:
            tasks = list(self.tasks)
        elif config.tasks == ENV_TASKS:
            tasks = []
        elif config.tasks:
            tasks = read_tasks(config.tasks)
        else:
            raise ValueError("--agent needs --tasks FILE.jsonl (or --tasks env: the tasks "
                             "--env's reset poses)")
        if self.eval_tasks is not None:
            eval_tasks = list(self.eval_tasks)
        else:
            eval_tasks = read_tasks(config.eval_tasks, "--eval-tasks") if config.eval_tasks else []
        if not tasks and config.tasks != ENV_TASKS:
            raise ValueError("an agent run needs at least one task")
        return program, tasks, eval_tasks


def check_agent(config: TrainConfig, inputs: AgentInputs) -> None:
    """A bad --agent, task file or (with `--tasks env`) env fails before the model loads."""
    inputs.resolve(config)
    if config.tasks == ENV_TASKS and inputs.tasks is None:
        EnvTasks(config.env, config.env_kwargs or {}).close()


def agent_source(config: TrainConfig, tokenizer: PreTrainedTokenizerBase,
                 inputs: AgentInputs | None = None) -> tuple[AgentSource, AgentGateway]:
    """The run's agent rollouts and the gateway they go through (started on first use;
    the caller stops it)."""
    program, tasks, eval_tasks = (inputs or AgentInputs()).resolve(config)
    fmt = chat_format_for(tokenizer)
    model = Path(config.model).name or config.model
    gateway = AgentGateway(model, SamplingDefaults(max_tokens=config.max_tokens,
                                                   temperature=config.temperature),
                           api_key=secrets.token_urlsafe(16))
    rollouts = AgentRollouts(program, gateway, lambda: CallTree(tokenizer, fmt), model,
                             AgentConfig(timeout_s=config.agent_timeout))
    env_tasks = (EnvTasks(config.env, config.env_kwargs or {})
                 if config.tasks == ENV_TASKS and not tasks else None)

    def close() -> None:
        gateway.stop()
        if env_tasks is not None:
            env_tasks.close()

    return AgentSource(config, rollouts, tasks, eval_tasks, close, env_tasks), gateway
