"""Publishing trained weights to the sampler: seconds per publish, full fine-tuning
and LoRA, on a checkpoint directory.

Usage: `python bench/bench_publish.py --model DIR [--publishes 6] [--lora-rank 16]
[--modes full,lora]`, e.g. `--model /tmp/real/smollm2` (docs/benchmarks.md,
"Publishing weights").

Each mode runs in a child process of its own: the service loaded, a training client
made (every weight, or LoRA adapters of `--lora-rank`), then `--publishes` publishes
(`save_weights_and_get_sampling_client`, no training between them: a publish's work
does not depend on what changed), each followed by a one-token sample from the new
version, timed apart: a tied head is packed at its first forward, so that sample
carries part of what a publish costs. After each pair the old versions are collected,
as a run's collector would. Prints each publish (wall seconds, the process's CPU
seconds, which another job's load inflates less, and the fresh pages it touched: on a
VM a first touch costs ~1 ms a MiB), then the medians of all but the first two (the
allocator settles by the third). The share of a GRPO step comes from a run's
own metrics (`time/publish_s` over `time/step_s` in metrics.jsonl). Knows the service
and its clients only.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_facts, setup_threads


@contextmanager
def measured(into: list[tuple[float, float, float]]) -> Iterator[None]:
    """Append the block's (wall s, CPU s of the whole process, MiB of fresh pages)."""
    wall, cpu = time.perf_counter(), time.process_time()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    yield
    fresh = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) * 4 / 1024
    into.append((time.perf_counter() - wall, time.process_time() - cpu, fresh))


def medians(runs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    wall, cpu, fresh = (statistics.median(column) for column in zip(*runs, strict=True))
    return wall, cpu, fresh


def shown(run: tuple[float, float, float]) -> str:
    return f"{run[0]:.3f} s ({run[1]:.2f} CPU-s, {run[2]:.0f} MiB of fresh pages)"


def child(args: argparse.Namespace, mode: str) -> None:
    from prefixgym.engine.service import EngineService
    from prefixgym.types import SamplingParams

    setup_threads(args.threads)
    service = EngineService(args.model, device="cpu")
    trainer = (service.create_lora_training_client(rank=args.lora_rank) if mode == "lora"
               else service.create_training_client())
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    publishes: list[tuple[float, float, float]] = []
    samples: list[tuple[float, float, float]] = []
    for i in range(args.publishes):
        with measured(publishes):
            client = trainer.save_weights_and_get_sampling_client()
        with measured(samples):
            client.sample([1, 2, 3], 1, one_token).result()
        gc.collect()
        print(f"{mode} publish {i + 1}: {shown(publishes[-1])}; first sample "
              f"{shown(samples[-1])}", flush=True)
    settled = slice(2, None) if len(publishes) > 2 else slice(None)
    print(f"{mode}: publish {shown(medians(publishes[settled]))}; first sample "
          f"{shown(medians(samples[settled]))} (medians of publishes "
          f"{(settled.start or 0) + 1}-{len(publishes)})", flush=True)
    service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory")
    parser.add_argument("--publishes", type=int, default=6)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    if args.child:
        child(args, args.child)
        return
    print(machine_facts(), flush=True)
    for mode in args.modes.split(","):
        subprocess.run([sys.executable, *sys.argv, "--child", mode], check=True)


if __name__ == "__main__":
    main()
