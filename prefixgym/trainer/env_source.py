"""Where a run's episodes come from when it trains an env: its envs, GRPO's step 1 on
them, and their evaluation.

`EnvSource` makes the envs once (B x G for GRPO, up to `EVAL_WIDTH` for evaluation) and
closes them when the run ends; `trainer.agent_steps.AgentSource` answers the same three
calls for an agent program's rollouts (`--agent`). The run holds one or the other.

Knows envs, rollouts and the sampling protocol; not checkpoints or the training loop.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from prefixgym.envs.registration import close_all
from prefixgym.protocols import SamplingClient
from prefixgym.rollouts.episode import AgentGymEnv
from prefixgym.rollouts.rollout import RolloutConfig, TraceWriter
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.evaluate import EVAL_WIDTH, EvalResult, evaluate
from prefixgym.trainer.grpo import Collected, collect
from prefixgym.trainer.progress import Progress
from prefixgym.types import JSONObject

MakeEnv = Callable[[JSONObject | None], AgentGymEnv]


class EnvSource:
    def __init__(self, config: TrainConfig, tokenizer: PreTrainedTokenizerBase,
                 make_env: MakeEnv, rollout_config: RolloutConfig) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.make_env = make_env
        self.rollout_config = rollout_config
        self.envs = [make_env(None) for _ in range(config.groups_per_step * config.group_size)]
        self.eval_envs = [make_env(None) for _ in range(min(config.eval_episodes, EVAL_WIDTH))]

    def collect(self, sampler: SamplingClient, step: int, rank: int, world: int,
                trace: TraceWriter | None) -> Collected:
        return collect(sampler, self.tokenizer, self.envs, self.config, step,
                       self.rollout_config, rank, world, trace)

    def evaluate(self, sampler: SamplingClient, temperature: float, when: str, name: str,
                 trace: TraceWriter | None) -> EvalResult:
        c = self.config
        with Progress(f"eval ({when})", c.eval_episodes, "episode", c.progress) as progress:
            return evaluate(
                sampler, self.tokenizer, self.eval_envs, c.eval_episodes, self.rollout_config,
                on_episodes=lambda n, done, wins: progress.update(n, success=f"{wins / done:.1%}"),
                temperature=temperature, trace=trace, name=name)

    def close(self) -> None:
        close_all([*self.envs, *self.eval_envs])
