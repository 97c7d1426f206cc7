"""`prefixgym rollout`: sample episodes of an env and print them with their cache hits.

Each turn prints the prompt length, how much of it came from the prefix cache, and
the reply; `--trace FILE.jsonl` also writes every sampling request in the trace
format that `prefixgym lint trace` reads.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from prefixgym.cli.flags import parse_config
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts, TraceWriter
from prefixgym.rollouts.types import TrajectoryGroup
from prefixgym.trainer.config import DEFAULT_ENV, default_env_kwargs
from prefixgym.types import JSONObject, Usage


@dataclass
class RolloutArgs:
    env: str = DEFAULT_ENV
    """Gymnasium id of the env."""
    env_kwargs: JSONObject | None = None
    """Keyword arguments for the env; unset: the same defaults as `prefixgym train`."""
    model: str = "tiny"
    """A built-in preset or a local Hugging Face checkpoint directory."""
    run: str = ""
    """A `prefixgym train --out` directory: sample from its latest checkpoint."""
    trace: str = ""
    """Write every sampling request to this JSONL file."""
    groups: int = 2
    """Groups to run (distinct env seeds)."""
    group_size: int = 2
    """Episodes per group, reset with one seed (their first turn is one request)."""
    seed: int = 0
    """Seed of the first group (the next groups count up)."""
    max_tokens: int = 16
    """Tokens per assistant turn at most."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""

    def __post_init__(self) -> None:
        if self.groups < 1 or self.group_size < 1:
            raise ValueError("--groups and --group-size must be at least 1")
        if self.env_kwargs is None:
            self.env_kwargs = default_env_kwargs(self.env)
        if not isinstance(self.env_kwargs, dict):
            raise ValueError(f"--env-kwargs must be a JSON object, got {self.env_kwargs!r}")


def print_group(group: TrajectoryGroup, out: TextIO = sys.stdout) -> None:
    for traj in group.trajectories:
        print(f"== episode {traj.episode_id} (seed {traj.seed})", file=out)
        for i, turn in enumerate(traj.turns):
            u = turn.usage
            hit = (f"cached {u.prefill_cached_tokens}/{u.prefill_tokens}"
                   if turn.usage.prefill_tokens else f"shared with {turn.shared_by - 1} others")
            print(f"  turn {i}: prompt {turn.prompt_length} tokens, {hit}; "
                  f"reward {turn.reward:+.2f}", file=out)
            print(f"    assistant: {turn.reply_text!r}", file=out)
        print(f"  -> {traj.stop_reason}; total reward {traj.total_reward:+.2f}, success "
              f"{traj.is_success}" + (f", error: {traj.error}" if traj.error else ""), file=out)


def main(argv: list[str]) -> int:
    args = parse_config(RolloutArgs, argv, prog="prefixgym rollout",
                        description="Sample episodes of an env; print transcripts and cache hits.")
    from prefixgym.envs.registration import make_agent_env
    from prefixgym.local_service import LocalService
    from prefixgym.protocols import SamplingClient
    from prefixgym.trainer.checkpoint import latest_checkpoint, load_checkpoint

    try:
        envs = [make_agent_env(args.env, args.env_kwargs) for _ in range(args.group_size)]
    except ValueError as e:
        print(f"prefixgym rollout: {e}", file=sys.stderr)
        return 2
    service = LocalService(model=args.model, seed=args.seed)
    sampler: SamplingClient = service.create_sampling_client()
    if args.run:
        ckpt = latest_checkpoint(Path(args.run))
        if ckpt is None:
            print(f"prefixgym rollout: no checkpoint under {args.run}", file=sys.stderr)
            return 2
        training = service.create_training_client()
        load_checkpoint(ckpt, training)
        sampler = training.save_weights_and_get_sampling_client()
    trace_file = open(args.trace, "w") if args.trace else None
    try:
        rollouts = Rollouts(
            sampler, service.tokenizer,
            RolloutConfig(max_tokens=args.max_tokens, temperature=args.temperature),
            trace=TraceWriter(trace_file) if trace_file else None,
        )
        for g in range(args.groups):
            group = asyncio.run(rollouts.run_group(envs, args.seed + g, f"g{g}"))
            print_group(group)
    finally:
        if trace_file:
            trace_file.close()
        service.close()
    print_usage(service.usage())
    return 0


def print_usage(usage: Usage) -> None:
    print(f"usage: prefill computed {usage.prefill_computed_tokens}, cached "
          f"{usage.prefill_cached_tokens} ({usage.cache_hit_rate:.0%}), sampled "
          f"{usage.sampled_tokens}")
