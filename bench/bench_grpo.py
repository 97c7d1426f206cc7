"""The default multi-turn GRPO loop: prefix cache on and off, shared training prefixes
on and off, deterministic rounds on and off, in one run.

Usage: `OMP_NUM_THREADS=2 python bench/bench_grpo.py [--steps 6] [--sft-steps 65]`.

One warm start (the default SFT) is computed once and loaded into three services:
the default (prefix cache on, training client sharing prefixes), the cache off
(`LocalService(prefix_cache=False)`), and sharing off
(`create_training_client(share_prefixes=False)`, cache on), and the deterministic
mode of `prefixgym train` (`LocalService(deterministic=True)`, rollouts in lockstep
rounds; the other modes run free). Then they run the same
GRPO steps (the default TrainConfig: 16 groups x 8 episodes of GuessNumber, 4 turns),
interleaved step by step so machine load hits all alike. Printed per mode: wall
seconds per step (whole step, sampling, and the rest: datums, update, publish), one
greedy evaluation of `--eval-episodes` at the end,
prefill tokens computed and served from the cache, train tokens computed and what
training would have computed without sharing. Knows the trainer's functions; no
engine internals.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_facts, setup_threads

from prefixgym.cli.train import compute_dtype
from prefixgym.envs.registration import make_env
from prefixgym.local_service import LocalService
from prefixgym.rollouts.rollout import RolloutConfig
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.evaluate import evaluate
from prefixgym.trainer.grpo import collect, grpo_step
from prefixgym.trainer.sft import warm_start


def make_envs(config: TrainConfig, n: int) -> list:
    return [make_env(config.env, config.env_kwargs) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sft-steps", type=int, default=TrainConfig.sft_steps)
    parser.add_argument("--eval-episodes", type=int, default=200)
    args = parser.parse_args()
    setup_threads(2)
    config = TrainConfig(steps=args.steps, sft_steps=args.sft_steps, progress=False)
    dtype = compute_dtype(config)
    free = RolloutConfig(max_tokens=config.max_tokens, temperature=config.temperature)
    lockstep = RolloutConfig(max_tokens=config.max_tokens, temperature=config.temperature,
                             lockstep=True)
    state_dir = Path(tempfile.mkdtemp(prefix="bench_grpo_")) / "warm"

    # 1) one warm start, saved
    with LocalService(seed=config.seed) as service:
        training = service.create_training_client()
        training.compute_dtype = dtype
        envs = make_envs(config, config.sft_episodes_per_step)
        t0 = time.perf_counter()
        warm_start(training, envs, service.tokenizer, config.sft_steps,
                   config.sft_episodes_per_step, config.sft_lr)
        training.save_state(state_dir).result()
        print(f"warm start: {config.sft_steps} steps in {time.perf_counter() - t0:.1f} s")

    # 2) four services from the same state, the same steps, interleaved
    modes = {"cache on, sharing on": (True, True, False), "cache off": (False, True, False),
             "sharing off": (True, False, False), "deterministic": (True, True, True)}
    runs = {}
    for name, (cache, share, deterministic) in modes.items():
        service = LocalService(seed=config.seed, prefix_cache=cache, deterministic=deterministic)
        training = service.create_training_client(share_prefixes=share)
        training.compute_dtype = dtype
        training.load_state(state_dir).result()
        runs[name] = {
            "service": service, "training": training,
            "sampler": training.save_weights_and_get_sampling_client(),
            "envs": make_envs(config, config.groups_per_step * config.group_size),
            "step_s": [], "sample_s": [], "rest_s": [], "computed": 0, "cached": 0, "train": 0,
            "train_unshared": 0, "rollout_config": lockstep if deterministic else free,
        }
    for step in range(config.steps):
        for r in runs.values():
            t0 = time.perf_counter()
            groups, sample_s = collect(r["sampler"], r["service"].tokenizer, r["envs"], config,
                                       step, r["rollout_config"])
            _, usage = grpo_step(r["training"], groups, config, None)
            r["sampler"] = r["training"].save_weights_and_get_sampling_client()
            r["step_s"].append(time.perf_counter() - t0)
            r["sample_s"].append(sample_s)
            r["rest_s"].append(r["step_s"][-1] - sample_s)
            r["computed"] += usage.prefill_computed_tokens
            r["cached"] += usage.prefill_cached_tokens
            r["train"] += usage.train_computed_tokens
            r["train_unshared"] += usage.train_tokens

    for r in runs.values():
        eval_envs = make_envs(config, min(args.eval_episodes, 100))
        t0 = time.perf_counter()
        evaluate(r["sampler"], r["service"].tokenizer, eval_envs, args.eval_episodes,
                 r["rollout_config"])
        r["eval_s"] = time.perf_counter() - t0

    print(machine_facts())
    print(f"{config.steps} GRPO steps, {config.groups_per_step} groups x {config.group_size}, "
          f"GuessNumber {config.env_kwargs}, compute {config.compute_dtype}")
    print("| mode | step s (median) | sampling s | rest s (update) | prefill computed | "
          f"prefill cached | train computed | train without sharing | eval s "
          f"({args.eval_episodes} ep.) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in runs.items():
        print(f"| {name} | {statistics.median(r['step_s']):.2f} | "
              f"{statistics.median(r['sample_s']):.2f} | {statistics.median(r['rest_s']):.2f} | "
              f"{r['computed']:,} | {r['cached']:,} | {r['train']:,} | {r['train_unshared']:,} | "
              f"{r['eval_s']:.1f} |")
        r["service"].close()
    base, det = runs["cache on, sharing on"], runs["deterministic"]
    print(f"deterministic / free-running: step {statistics.median(det['step_s']) / statistics.median(base['step_s']):.2f}x, "
          f"sampling {statistics.median(det['sample_s']) / statistics.median(base['sample_s']):.2f}x, "
          f"eval {det['eval_s'] / base['eval_s']:.2f}x")
    print(machine_facts())


if __name__ == "__main__":
    main()
