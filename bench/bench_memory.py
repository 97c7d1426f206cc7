"""Peak resident memory per GRPO step of `prefixgym train` on a checkpoint directory,
full fine-tuning and LoRA, and of publishes with no training between them.

Usage: `python bench/bench_memory.py --model DIR --env ENV [--steps 24] [--lora-rank 16]
[--publishes 8] [--modes publish,full,lora] [--groups-per-step 16] [--keep-free-memory]
[--recompute-activations]`, e.g. `--model /tmp/real/smollm2 --env
/tmp/real/addition.py:Addition` (docs/benchmarks.md, "Memory per GRPO step").

Each mode runs in a child process of its own (a process's peak never goes down):
  1) full / lora: `build_run` of the run `prefixgym train --model DIR --env ENV --steps
     N` would make (the checkpoint directory's defaults applied, as `train_args.py`
     does), with evaluation and checkpoints left out (they sample or write, not train);
     after each publish (a GRPO step's last act) the process's peak RSS so far, the
     step's own peak (VmHWM, reset after each publish by `/proc/self/clear_refs`), its
     RSS now (VmRSS), and the tokens the step's forward_backward took and the positions
     it computed (a shared prompt once). A step's own peak follows the positions it
     computed (activations, ~1.2 MB a position on SmolLM2-135M in bf16) and, in full
     training, whether Adam's moments exist yet (made by the first update, after the
     first forward_backward's peak): compare steps of like size after the first update;
  2) publish: the service loaded and a full training client made, then `--publishes`
     publishes with no step between them, RSS after each.
Last line per mode: peak after step 4 and after the last step, and their ratio (the
bar of issue 61: within 1.10). Knows the run's builder and the service's clients; no
engine internals.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_facts, setup_threads


def memory_mib() -> tuple[float, float]:
    """(peak RSS since the last `reset_peak`, RSS now) of this process, MiB, from
    /proc/self/status."""
    fields: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                fields[name] = int(value.split()[0]) / 1024  # kB
    return fields["VmHWM"], fields["VmRSS"]


def reset_peak() -> bool:
    """Set VmHWM to the RSS now (Linux's clear_refs "5"); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def report(label: str, peaks: list[float]) -> None:
    if len(peaks) > 4:
        print(f"{label}: peak after step 4 {peaks[3]:.0f} MiB, after step {len(peaks)} "
              f"{peaks[-1]:.0f} MiB, ratio {peaks[-1] / peaks[3]:.3f}", flush=True)


def run_steps(args: argparse.Namespace, lora: bool) -> None:
    from prefixgym.trainer.model_defaults import pretrained_defaults

    settings = {"model": args.model, "env": args.env, "steps": args.steps,
                "lora_rank": args.lora_rank if lora else 0, "num_threads": args.threads,
                "seed": args.seed, "groups_per_step": args.groups_per_step,
                "group_size": args.group_size,
                "recompute_activations": args.recompute_activations}
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as out:  # 2 GB at 135M
        measure_steps(args, lora, {**settings, **pretrained_defaults(settings),
                                   "eval_on_start": False, "eval_every": 10**6,
                                   "checkpoint_every": 10**6, "progress": False, "out": out})


def measure_steps(args: argparse.Namespace, lora: bool, settings: dict[str, Any]) -> None:
    from prefixgym.cli.train import build_run
    from prefixgym.trainer.config import TrainConfig

    config = TrainConfig(**settings)
    # (the last step still evaluates and checkpoints: after its publish, not measured)
    run, _ = build_run(config)
    label = f"lora rank {args.lora_rank}" if lora else "full"
    print(f"{label}: loaded, peak {memory_mib()[0]:.0f} MiB, now {memory_mib()[1]:.0f} MiB",
          flush=True)
    publish = run.training.save_weights_and_get_sampling_client
    forward_backward = run.training.forward_backward
    peaks: list[float] = []  # the process's, after each publish
    process_peak = memory_mib()[0]
    resets = reset_peak()
    calls: list[tuple[int, Any]] = []  # the step's forward_backward calls: tokens, future

    def counted_forward_backward(data: Any, *args: Any, **kwargs: Any) -> Any:
        future = forward_backward(data, *args, **kwargs)
        calls.append((sum(d.model_input.length for d in data), future))
        return future

    last = [time.perf_counter()]

    def measured_publish(name: str | None = None) -> Any:
        nonlocal process_peak
        sampler = publish(name)
        step_peak, now = memory_mib()
        seconds, last[0] = time.perf_counter() - last[0], time.perf_counter()
        process_peak = max(process_peak, step_peak)
        peaks.append(process_peak)
        tokens = sum(n for n, _ in calls)
        computed = sum(f.result().usage.train_computed_tokens for _, f in calls)
        own = f"step's own {step_peak:.0f} MiB, " if resets else ""
        print(f"{label} step {len(peaks) - 1}: peak {process_peak:.0f} MiB, {own}now "
              f"{now:.0f} MiB, trained {tokens} tokens ({computed} computed), {seconds:.1f} s",
              flush=True)
        calls.clear()
        reset_peak()
        return sampler

    run.training.forward_backward = counted_forward_backward  # type: ignore[method-assign]
    run.training.save_weights_and_get_sampling_client = measured_publish  # type: ignore[method-assign]
    run.run()
    # the first publish (before step 0) is the starting weights': drop it from the steps
    report(label, peaks[1:])


def run_publishes(args: argparse.Namespace) -> None:
    from prefixgym.local_service import LocalService

    service = LocalService(model=args.model, num_threads=args.threads)
    training = service.create_training_client()
    peak, now = memory_mib()
    print(f"publish: loaded, peak {peak:.0f} MiB, now {now:.0f} MiB", flush=True)
    peaks = []
    for i in range(args.publishes):
        training.save_weights_and_get_sampling_client()
        peak, now = memory_mib()
        peaks.append(peak)
        print(f"publish {i + 1}: peak {peak:.0f} MiB, now {now:.0f} MiB", flush=True)
    report("publish", peaks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint directory")
    p.add_argument("--env", default="prefixgym/Arithmetic-v0")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--publishes", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--keep-free-memory", action="store_true",
                   help="publishes leave malloc's free bytes resident (the state before "
                        "they were trimmed), for comparison")
    p.add_argument("--recompute-activations", action="store_true",
                   help="train with --recompute-activations (backward keeps each block's "
                        "input only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="publish,full,lora")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    setup_threads(args.threads)
    if args.keep_free_memory:
        from prefixgym.engine import malloc_tuning

        malloc_tuning.release_free_memory = lambda: False
    if args.child == "publish":
        return run_publishes(args)
    if args.child:
        return run_steps(args, lora=args.child == "lora")
    print(machine_facts(), json.dumps(vars(args)), flush=True)
    for mode in args.modes.split(","):
        subprocess.run([sys.executable, *sys.argv, "--child", mode], check=True)


if __name__ == "__main__":
    main()
