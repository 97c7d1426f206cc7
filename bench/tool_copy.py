"""Does the warm start learn to use Arithmetic's calculator? Copy accuracy during SFT.

Usage: `python bench/tool_copy.py [--model tiny] [--sft-steps 320] [--every 40]
[--sft-lr 2e-3] [--env-kwargs '{"expert_tool_rate": 1.0, "num_operands": 2}']`

Tool use is copying: the question's expression into the calculator call, the tool's
result into the answer. This runs the warm start of `prefixgym train` (the same
`warm_start`, 16 expert episodes a step) and every `--every` steps samples
`--episodes` held-out episodes at temperature 1, printing one JSON line: the share
that call the calculator first, the share of those calls whose expression is exactly
the question's, the share of those that then answer with the tool's result, and
success. A tool recipe (docs/training-your-env.md, section 5) needs the copies right
before GRPO can raise the share of calls. Figures: docs/benchmarks.md, "Tool use on
Arithmetic". Knows the warm start, rollouts and Arithmetic's task; not GRPO.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import prefixgym as pg
from prefixgym.envs.arithmetic import Arithmetic
from prefixgym.envs.registration import make_agent_env
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts
from prefixgym.trainer.evaluate import EVAL_SEED_BASE
from prefixgym.trainer.sft import warm_start

EXPRESSION_RE = re.compile(r'"expression": "([^"]*)"')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sft-steps", type=int, default=320)
    parser.add_argument("--every", type=int, default=40, help="probe every this many steps")
    parser.add_argument("--sft-lr", type=float, default=2e-3)
    parser.add_argument("--episodes", type=int, default=96, help="held-out episodes a probe")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env-kwargs", type=json.loads,
                        default={"expert_tool_rate": 1.0, "max_turns": 3, "num_operands": 2})
    args = parser.parse_args()
    service = pg.LocalService(model=args.model, seed=args.seed, num_threads=args.threads)
    tokenizer, training = service.tokenizer, service.create_training_client()
    make = lambda: make_agent_env("prefixgym/Arithmetic-v0", args.env_kwargs)  # noqa: E731
    envs = [make() for _ in range(16)]
    probe_envs = [make() for _ in range(args.episodes)]
    # the same tasks as probe_envs: a seed's task does not depend on expert_tool_rate
    reference = Arithmetic(**{k: v for k, v in args.env_kwargs.items()
                              if k != "expert_tool_rate"})

    def probe(step: int) -> None:
        sampler = training.save_weights_and_get_sampling_client()
        rollouts = Rollouts(sampler, tokenizer, RolloutConfig(
            max_tokens=args.max_tokens, temperature=1.0, max_turns=3, lockstep=True))
        groups = asyncio.run(rollouts.run_groups(
            [([env], EVAL_SEED_BASE + i, f"probe/{i}") for i, env in enumerate(probe_envs)]))
        calls = copied = answered = wins = 0
        for i, group in enumerate(groups):
            episode = group.trajectories[0]
            wins += episode.is_success
            reference.reset(seed=EVAL_SEED_BASE + i)
            first = episode.turns[0].reply_text
            if not first.startswith("<tool_call>"):
                continue
            calls += 1
            match = EXPRESSION_RE.search(first)
            if match is None or match.group(1) != reference._expression:
                continue
            copied += 1
            answered += (len(episode.turns) > 1
                         and episode.turns[1].reply_text.strip() == str(reference._answer))
        n = len(groups)
        print(json.dumps({"sft_step": step, "calls": calls / n,
                          "expression_copied_of_calls": copied / max(calls, 1),
                          "result_copied_of_copied": answered / max(copied, 1),
                          "success": wins / n}), flush=True)

    def on_step(i: int, metrics: dict[str, float], usage: pg.Usage) -> None:
        if (i + 1) % args.every == 0:
            probe(i + 1)

    warm_start(training, envs, tokenizer, args.sft_steps, 16, args.sft_lr, on_step=on_step)


if __name__ == "__main__":
    main()
