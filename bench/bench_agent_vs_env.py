"""The tools recipe's task trained twice from one start: as the env, and as an agent
program over the `openai` client (examples/agents/arithmetic.py) through the gateway.

  1) the recipe's warm start (prefixgym/recipes/tools.toml, GRPO steps 0), its weights
     saved as a model directory: the one start of both runs;
  2) the env: `--env prefixgym/Arithmetic-v0` with the recipe's GRPO settings, from it;
  3) the agent: `--agent examples/agents/arithmetic.py:agent`, the same settings, the
     tasks the env's seeds pose (training: the seeds GRPO's steps would reset with;
     evaluation: the env's held-out seeds), from it.
Prints, for each: success before and after GRPO with standard errors, the gain in
standard errors, the share of GRPO's prompt tokens served from the prefix cache (per
request: a request for G samples counts its prompt once), the share of every turn's
prompt that was not computed (per turn: `tokens/turn_prompts`, the same measure for
both, however the requests were grouped), prefill computed, and the wall time.

    .venv/bin/python bench/bench_agent_vs_env.py [--seed 0] [--steps 40] [--out runs/agent-vs-env]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tomllib
from pathlib import Path

from prefixgym.cli.train import build_run
from prefixgym.envs.registration import make_agent_env
from prefixgym.recipes import config_path
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.evaluate import EVAL_SEED_BASE
from prefixgym.trainer.grpo import step_seeds

ROOT = Path(__file__).resolve().parents[1]
AGENT = f"{ROOT / 'examples' / 'agents' / 'arithmetic.py'}:agent"


def recipe() -> dict:
    return tomllib.loads(Path(config_path("tools")).read_text())


def write_tasks(path: Path, seeds: list[int], env_kwargs: dict) -> None:
    env = make_agent_env("prefixgym/Arithmetic-v0", env_kwargs)
    with path.open("w") as f:
        for seed in seeds:
            obs, _ = env.reset(seed=seed)
            f.write(json.dumps({"question": obs[0]["content"], "answer": env.unwrapped._answer})
                    + "\n")
    env.close()


def run(config: TrainConfig) -> tuple[list[dict], float]:
    start = time.perf_counter()
    built, service = build_run(config)
    built.run()
    if service is not None:
        service.close()
    lines = [json.loads(x) for x in (Path(config.out) / "metrics.jsonl").read_text().splitlines()]
    return lines, time.perf_counter() - start


def summary(name: str, lines: list[dict], wall: float) -> dict:
    evals = [r for r in lines if r["phase"] == "eval"]
    first, last = evals[0], evals[-1]
    grpo = [r for r in lines if r["phase"] == "grpo"]
    cached = sum(r["tokens/prefill_cached"] for r in grpo)
    prompt = cached + sum(r["tokens/prefill_computed"] for r in grpo)
    turn_prompts = sum(r["tokens/turn_prompts"] for r in grpo)
    computed = prompt - cached
    gain = last["eval/success"] - first["eval/success"]
    se = math.hypot(first["eval/success_stderr"], last["eval/success_stderr"])
    return {"run": name, "before": first["eval/success"], "before_se": first["eval/success_stderr"],
            "after": last["eval/success"], "after_se": last["eval/success_stderr"],
            "gain_se": gain / se if se else float("inf"), "cache_hit": cached / prompt,
            "prompt_tokens": prompt, "computed": computed,
            "not_computed": 1 - computed / turn_prompts if turn_prompts else 0.0,
            "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/agent-vs-env")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = recipe()
    env_kwargs = r["env_kwargs"]
    common = dict(seed=args.seed, max_tokens=r["max_tokens"], lr=r["lr"], steps=args.steps,
                  eval_every=r["eval_every"], eval_episodes=r["eval_episodes"], progress=True)
    start_dir = out / "start"
    if not (start_dir / "config.json").exists():  # 1) the warm start, once
        print("1) the recipe's warm start", file=sys.stderr)
        warm = TrainConfig(env=r["env"], env_kwargs=env_kwargs, sft_steps=r["sft_steps"],
                           sft_stages=r["sft_stages"],
                           sft_episodes_per_step=r["sft_episodes_per_step"],
                           sft_lr_schedule=r["sft_lr_schedule"], sft_warmup=r["sft_warmup"],
                           **{**common, "steps": 0}, out=str(out / "warm"))
        built, service = build_run(warm)
        built.run()
        assert service is not None
        service.save_hf_dir(start_dir)
        service.close()
    config = TrainConfig(steps=args.steps, groups_per_step=16, group_size=8)
    seeds = [s for step in range(args.steps) for s in step_seeds(config, step)]
    write_tasks(out / "tasks.jsonl", seeds, env_kwargs)
    write_tasks(out / "eval_tasks.jsonl",
                [EVAL_SEED_BASE + i for i in range(r["eval_episodes"])], env_kwargs)
    print("2) GRPO on the env", file=sys.stderr)
    env_lines, env_wall = run(TrainConfig(
        env=r["env"], env_kwargs=env_kwargs, model=str(start_dir), sft_steps=0, **common,
        out=str(out / "env")))
    print("3) GRPO on the agent program", file=sys.stderr)
    agent_lines, agent_wall = run(TrainConfig(
        agent=AGENT, tasks=str(out / "tasks.jsonl"), eval_tasks=str(out / "eval_tasks.jsonl"),
        model=str(start_dir), sft_steps=0, **common, out=str(out / "agent")))
    rows = [summary("env", env_lines, env_wall), summary("agent", agent_lines, agent_wall)]
    print(f"{'run':6} {'before':>14} {'after':>14} {'gain':>8} {'cache hit':>10} "
          f"{'not computed':>13} {'computed':>9} {'wall':>7}")
    for s in rows:
        print(f"{s['run']:6} {s['before']:7.1%} ± {s['before_se']:4.1%} "
              f"{s['after']:7.1%} ± {s['after_se']:4.1%} {s['gain_se']:6.1f} SE "
              f"{s['cache_hit']:9.1%} {s['not_computed']:12.1%} {s['computed']:9,.0f} "
              f"{s['wall_s']:6.0f}s")
    env, agent = rows
    print(f"agent - env: cache hit {100 * (agent['cache_hit'] - env['cache_hit']):+.1f} points, "
          f"turn prompts not computed {100 * (agent['not_computed'] - env['not_computed']):+.1f} "
          f"points; agent / env: prefill computed {agent['computed'] / env['computed']:.2f}x, "
          f"wall {agent['wall_s'] / env['wall_s']:.2f}x")
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
