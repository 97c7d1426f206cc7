"""Evaluation: greedy (or sampled) episodes on held-out env seeds, success rate with
its error.

Held-out seeds start at `EVAL_SEED_BASE`, far from the training seeds, so no eval
episode was ever trained on. Knows rollouts and envs; not how the model is trained.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from prefixgym.protocols import SamplingClient
from prefixgym.rollouts.episode import AgentGymEnv
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts, TraceWriter
from prefixgym.rollouts.types import Trajectory
from prefixgym.types import Usage

EVAL_SEED_BASE = 1_000_000
EVAL_WIDTH = 256
"""Evaluation episodes a run plays at once (the local engine's default `max_running`):
wider rounds than that only queue. Episodes are seeded one by one, so the width changes
the time an evaluation takes, not what it measures: a row's logprobs could differ in
their last bits with its batch, but no sampled token has changed with the width yet
(1500 episodes of the default run at widths 100 and 256, each with the same outcome;
tests/trainer/test_evaluate.py checks a small case)."""


@dataclass
class EvalResult:
    """Success and reward over the `episodes` the env played to their end; the
    `env_errors` episodes its env raised in (a refused session, a crash) are apart."""

    success: float
    success_stderr: float
    reward: float
    reward_stderr: float
    episodes: int
    usage: Usage
    env_errors: int = 0
    first_error: str = ""
    env_s: float = 0.0  # seconds the envs spent in reset and step, summed over episodes

    def as_metrics(self, prefix: str = "eval") -> dict[str, float]:
        return {
            f"{prefix}/success": self.success,
            f"{prefix}/success_stderr": self.success_stderr,
            f"{prefix}/reward/mean": self.reward,
            f"{prefix}/reward/stderr": self.reward_stderr,
            f"{prefix}/episodes": float(self.episodes),
            f"{prefix}/env_errors": float(self.env_errors),
        }


def success_stderr(p: float, n: int) -> float:
    """Standard error of a success rate over n independent episodes."""
    return math.sqrt(p * (1.0 - p) / n) if n else 0.0


def summarize(trajectories: Sequence[Trajectory]) -> EvalResult:
    usage = Usage.total(t.usage for t in trajectories)
    errors = [t for t in trajectories if t.failed]
    played = [t for t in trajectories if not t.failed]
    n = len(played)
    successes = sum(t.is_success for t in played)
    p = successes / n if n else 0.0
    rewards = [t.total_reward for t in played]
    reward = sum(rewards) / n if n else 0.0
    spread = math.sqrt(sum((r - reward) ** 2 for r in rewards) / n) if n else 0.0
    return EvalResult(p, success_stderr(p, n), reward, spread / math.sqrt(n) if n else 0.0,
                      n, usage, len(errors), errors[0].error or "" if errors else "",
                      sum(t.env_s for t in trajectories))


def evaluate(
    sampler: SamplingClient, tokenizer: PreTrainedTokenizerBase, envs: Sequence[AgentGymEnv],
    episodes: int, config: RolloutConfig, concurrency: int | None = None,
    on_episodes: Callable[[int, int, int], None] | None = None, temperature: float = 0.0,
    trace: TraceWriter | None = None, name: str = "eval",
) -> EvalResult:
    """Episodes on seeds EVAL_SEED_BASE + i, `len(envs)` at a time, greedy or sampled at
    `temperature` (seeded per episode, so the same weights give the same result).
    `on_episodes(n, done, successes)` is called after each batch of n episodes (`done`
    counts env errors too). Each sampling request goes to `trace` too, when given; its
    episodes' ids start with `name`, which a run makes unique to each evaluation."""
    rollouts = Rollouts(sampler, tokenizer,
                        RolloutConfig(**{**config.__dict__, "temperature": temperature}), trace)
    width = min(concurrency or len(envs), len(envs))

    async def _all() -> list[Trajectory]:
        out: list[Trajectory] = []
        for start in range(0, episodes, width):
            seeds = range(start, min(start + width, episodes))
            groups = await rollouts.run_groups([
                ([envs[i % width]], EVAL_SEED_BASE + s, f"{name}/{s}") for i, s in enumerate(seeds)
            ])
            out.extend(t for g in groups for t in g.trajectories)
            if on_episodes is not None:
                on_episodes(len(seeds), len(out), sum(t.is_success for t in out))
        return out

    return summarize(asyncio.run(_all()))
