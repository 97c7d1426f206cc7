"""`prefixgym train --agent`: the gateway its program calls and the rollouts it runs.

Builds, from the run's config and the tokenizer of the model it trains, what the run
needs in place of envs: an `AgentGateway` (a loopback OpenAI endpoint per rollout,
keyed by a fresh token), the program loaded from `--agent`, a `CallTree` per rollout in
the model's own chat format and tool-call syntax, and the tasks of `--tasks` and
`--eval-tasks`. Knows commands' inputs; the parts it builds know the rest.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from prefixgym.prompting.call_tree import CallTree
from prefixgym.prompting.chat_format import ChatMLFormat
from prefixgym.prompting.conversation import chat_format_for
from prefixgym.prompting.tool_syntax import syntax_for_template
from prefixgym.rollouts.agent import AgentConfig, AgentRollouts, load_agent
from prefixgym.serving.agent_gateway import AgentGateway
from prefixgym.serving.agent_session import SamplingDefaults
from prefixgym.trainer.agent_steps import AgentSource, read_tasks
from prefixgym.trainer.config import TrainConfig


def check_agent(config: TrainConfig) -> None:
    """A bad --agent or task file fails before the model loads."""
    load_agent(config.agent)
    read_tasks(config.tasks)
    if config.eval_tasks:
        read_tasks(config.eval_tasks, "--eval-tasks")


def agent_source(config: TrainConfig, tokenizer: PreTrainedTokenizerBase
                 ) -> tuple[AgentSource, AgentGateway]:
    """The run's agent rollouts and the gateway they go through (started on first use;
    the caller stops it)."""
    program = load_agent(config.agent)
    fmt = chat_format_for(tokenizer)
    syntax = syntax_for_template(tokenizer.chat_template,
                                 builtin=isinstance(fmt, ChatMLFormat))
    model = Path(config.model).name or config.model
    gateway = AgentGateway(model, SamplingDefaults(max_tokens=config.max_tokens,
                                                   temperature=config.temperature),
                           api_key=secrets.token_urlsafe(16))
    rollouts = AgentRollouts(program, gateway, lambda: CallTree(tokenizer, fmt, syntax), model,
                             AgentConfig(timeout_s=config.agent_timeout))
    tasks = read_tasks(config.tasks)
    eval_tasks = read_tasks(config.eval_tasks, "--eval-tasks") if config.eval_tasks else []
    return AgentSource(rollouts, tasks, eval_tasks, gateway.stop), gateway
