"""The default training run on several seeds: does GRPO beat its warm start on each?

Usage: `python bench/bench_seeds.py [--seeds 0 1 2 3 4] [--parallel 1] [--out runs/seeds]
[-- TRAIN FLAGS...]`, e.g. `python bench/bench_seeds.py -- --eval-temperature 1`.

Runs `prefixgym train --seed S --out OUT/seedS --no-progress [TRAIN FLAGS]` for every
seed (`--parallel N` at a time, each on `--threads` torch threads), then reads each
run's metrics.jsonl and prints one table: wall seconds, the machine's load average
at start and end, eval success (at the runs' `eval/temperature`) after the warm start
and after GRPO (± binomial SE, sqrt(p(1-p)/n)), and GRPO's gain in points and in SE
of the difference (sqrt(se1² + se2²)), the criterion of issue 20 being > 5 SE on every seed.
`--report-only` prints the table of runs already in OUT. Runs are deterministic
(`prefixgym train --deterministic`, the default), so a seed's figures repeat on one
machine and engine; the wall times do not.
Knows the CLI and the metrics.jsonl format; nothing of the trainer's internals.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path


def evals(run: Path) -> dict[str, dict[str, float]]:
    """The run's eval lines by `when` (the last GRPO one as "after GRPO"); none for a
    run that has not logged yet."""
    found: dict[str, dict[str, float]] = {}
    metrics = run / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        record = json.loads(line) if line.strip() else {}
        if record.get("phase") == "eval":
            found["after GRPO" if record["when"] == "GRPO" else record["when"]] = record
    return found


def row(seed: int, run: Path, wall: str, load: str) -> str:
    found = evals(run)
    warm, grpo = found.get("after warm start"), found.get("after GRPO")
    if warm is None or grpo is None:
        return f"| {seed} | {wall} | {load} | – | – | – | – |"
    p1, s1 = warm["eval/success"], warm["eval/success_stderr"]
    p2, s2 = grpo["eval/success"], grpo["eval/success_stderr"]
    se = math.sqrt(s1 ** 2 + s2 ** 2)
    diff = p2 - p1
    ratio = diff / se if se else float("inf")
    return (f"| {seed} | {wall} | {load} | {100 * p1:.1f} ± {100 * s1:.1f}% | "
            f"{100 * p2:.1f} ± {100 * s2:.1f}% | {100 * diff:+.1f} ± {100 * se:.1f} | "
            f"**{ratio:+.1f}** |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per run (0: 2 // parallel, at least 1)")
    parser.add_argument("--out", default="runs/seeds")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("train_flags", nargs="*", help="after --: flags for prefixgym train")
    args = parser.parse_args()
    threads = args.threads or max(1, 2 // args.parallel)
    out = Path(args.out)
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    timing: dict[int, tuple[str, str]] = {}
    pending = [] if args.report_only else list(args.seeds)
    running: list[tuple[int, subprocess.Popen[bytes], float, str]] = []
    while pending or running:
        while pending and len(running) < args.parallel:
            seed = pending.pop(0)
            cmd = [sys.executable, "-m", "prefixgym", "train", "--seed", str(seed),
                   "--out", str(out / f"seed{seed}"), "--no-progress",
                   "--num-threads", str(threads), *args.train_flags]
            print(" ".join(cmd[1:]), file=sys.stderr)
            running.append((seed, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL),
                            time.perf_counter(), f"{os.getloadavg()[0]:.1f}"))
        time.sleep(1.0)
        for item in [r for r in running if r[1].poll() is not None]:
            seed, proc, t0, load0 = item
            running.remove(item)
            if proc.returncode != 0:
                print(f"seed {seed}: prefixgym train exited {proc.returncode}", file=sys.stderr)
            timing[seed] = (f"{time.perf_counter() - t0:.0f} s",
                            f"{load0}, {os.getloadavg()[0]:.1f}")
    print("| seed | wall | load (start, end) | after warm start | after GRPO | "
          "GRPO − warm start (points) | in SE |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for seed in args.seeds:
        wall, load = timing.get(seed, ("–", "–"))
        print(row(seed, out / f"seed{seed}", wall, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
