"""Bounded staleness (--max-staleness K) measured: speed, learning and the mismatch.

Usage: `python bench/bench_staleness.py PART [--out runs/staleness] [options]`, PART one of
- `speed`: GRPO steps per minute with two samplers, two `prefixgym serve` processes
  (`--sampler-url` twice, LoRA adapters pushed every step) on the first seed's warm
  start (the learning part's, exported as a model directory), at each K of `--ks`, the
  K's alternating `--repeats` times (in order, then backwards) so that a drift of the
  machine's load reaches all of them; steps per minute from the runs' `time/step_s` past the first K + 1 steps
  (the pipeline filling up), the ratio against K = 0 of the same repeat. `--model
  PATH` (a checkpoint directory or .gguf file) runs trainer and servers on that model
  instead, with the flags after `--` (e.g. `-- --config addition`).
- `learning`: per seed one warm start (`--steps 0`, `--sft-steps` of them), then GRPO
  from its checkpoint (`--resume --force-resume`, so every arm starts from the same
  bits) in the arms of `--arms`: K = 0, K = 2 without a correction, K = 2 with
  `--off-policy-correction tis` or `mis` (the default `--off-policy-ratio sampler`), and
  K = 2 with tis in the decoupled form (`K2-tis-trainer`); in process, where the lag is forced: a step
  sampled ahead trains exactly K updates after its weights, whatever the timing. Eval
  success after GRPO with its binomial SE, the gain over the warm start, each arm's
  mean over the seeds, and each K = 2 arm against K = 0 of its seed in SE of the
  difference; then each arm's mismatch metrics. Flags after `--` go to every GRPO run
  of the part (e.g. `-- --lr-schedule constant`).
- `mismatch`: bf16 samplers (two `prefixgym serve --dtype bfloat16`) under an fp32
  trainer, from the first seed's warm start (resumed, pushed to the server as full
  weights),
  a few GRPO steps at K = 0 with each correction (none, tis, mis): the logprob gap,
  k3, and the tokens the correction capped or masked.
`--report-only` prints the tables of runs already in OUT. Every part prints the
machine's load average beside its table: on a shared machine the speed figures move
with it, the learning ones do not (runs are deterministic).
Knows the CLI, `prefixgym serve` and the metrics.jsonl format; nothing of the trainer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from prefixgym.serving.launch import ServerProcess, free_port

ARMS = {"K0": ["--max-staleness", "0"],
        "K2": ["--max-staleness", "2"],
        "K2-tis": ["--max-staleness", "2", "--off-policy-correction", "tis"],
        "K2-mis": ["--max-staleness", "2", "--off-policy-correction", "mis"],
        "K2-tis-trainer": ["--max-staleness", "2", "--off-policy-correction", "tis",
                           "--off-policy-ratio", "trainer"]}
CORRECTIONS = ("none", "tis", "mis")


def records(run: Path, phase: str) -> list[dict[str, float]]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, filter(None, lines)) if r.get("phase") == phase]


def train(out: Path, flags: Sequence[str], threads: int) -> float:
    """`prefixgym train` in a process of its own; its wall seconds."""
    cmd = [sys.executable, "-m", "prefixgym", "train", "--out", str(out), "--no-progress",
           "--num-threads", str(threads), *flags]
    print(" ".join(cmd[1:]), f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"prefixgym train exited {done.returncode}: "
                         f"{done.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - t0


def warm_start(args: argparse.Namespace) -> Path:
    """The first seed's warm-start run (the learning part's)."""
    warm = args.out / "learning" / f"seed{args.seeds[0]}" / "warm"
    if success(warm, "after warm start") is None:
        raise SystemExit(f"no warm start in {warm}: run the learning part first")
    return warm


def export_weights(warm: Path, seed: int, directory: Path) -> Path:
    """The warm start's weights as a Hugging Face directory (`--model` for the trainer
    and the servers): a random init's replies all fail the default env, so GRPO
    would skip every group and train nothing."""
    if not (directory / "config.json").exists():
        from prefixgym.local_service import LocalService

        with LocalService(model="tiny", seed=seed) as service:
            training = service.create_training_client()
            training.load_state(warm / "checkpoints" / "warm_start" / "train").result()
            service.save_hf_dir(directory)
    return directory


@contextmanager
def servers(count: int, out: Path, model: str = "tiny", dtype: str = "float32",
            lora_rank: int = 0) -> Iterator[list[str]]:
    """`count` `prefixgym serve` processes on the trainer's base weights (`model`,
    seed 0), one torch thread each; their /v1 URLs."""
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        urls = []
        for i in range(count):
            port = free_port()
            argv = [sys.executable, "-m", "prefixgym", "serve", "--model", model, "--seed", "0",
                    "--port", str(port), "--dtype", dtype, "--log-level", "warning"]
            if lora_rank:
                argv += ["--lora-rank", str(lora_rank)]
            url = f"http://127.0.0.1:{port}"
            server = ServerProcess(argv, url, {"OMP_NUM_THREADS": "1"},
                                   log_path=out / f"serve{i}.log", name="prefixgym serve")
            stack.enter_context(server)
            server.wait_ready(timeout_s=300, progress=False)
            urls.append(url + "/v1")
        yield urls


def step_seconds(run: Path, k: int) -> list[float]:
    """The run's GRPO steps' seconds past the first K + 1 (the pipeline filling up)."""
    return [r["time/step_s"] for r in records(run, "grpo")[k + 1:]]


def speed(args: argparse.Namespace) -> None:
    out = args.out / "speed"
    if not args.report_only:
        base = (args.model if args.model else
                str(export_weights(warm_start(args), args.seeds[0], out / "base")))
        with servers(2, out, model=base, lora_rank=args.lora_rank) as urls:
            for repeat in range(args.repeats):  # K's in order, then backwards: ABC CBA
                for k in args.ks if repeat % 2 == 0 else args.ks[::-1]:
                    run = out / f"r{repeat}-K{k}"
                    shutil.rmtree(run, ignore_errors=True)
                    flags = [*args.grpo_flags, "--model", base, "--sft-steps", "0", "--steps",
                             str(args.steps), "--eval-episodes", "16", "--no-eval-on-start",
                             "--eval-every", "1000", "--checkpoint-every", "1000",
                             "--lora-rank", str(args.lora_rank), "--max-staleness", str(k),
                             *[f for url in urls for f in ("--sampler-url", url)]]
                    train(run, flags, args.threads)
    print(f"GRPO steps per minute, two prefixgym serve samplers, over the steps past the "
          f"first K + 1 (in brackets: the slowest and fastest step's rate; load now "
          f"{os.getloadavg()[0]:.1f}):\n")
    print("| repeat | " + " | ".join(f"K = {k}" for k in args.ks) + " | "
          + " | ".join(f"K = {k} / K = 0" for k in args.ks if k) + " |")
    print("|---|" + "---:|" * (2 * len(args.ks) - 1))
    for repeat in range(args.repeats):
        seconds = {k: step_seconds(out / f"r{repeat}-K{k}", k) for k in args.ks
                   if success(out / f"r{repeat}-K{k}", "GRPO") is not None}  # finished
        if len(seconds) == len(args.ks):
            rates = {k: 60 * len(s) / sum(s) for k, s in seconds.items()}
            cells = [f"{rates[k]:.2f} ({60 / max(seconds[k]):.2f}-{60 / min(seconds[k]):.2f})"
                     for k in args.ks]
            ratios = [f"{rates[k] / rates[0]:.2f}x" for k in args.ks if k]
            print(f"| {repeat} | " + " | ".join(cells + ratios) + " |")
    for run in sorted(out.glob("r*-K*")):  # a server marked down leaves one sampler
        steps = records(run, "grpo")
        for key in sorted({k for r in steps for k in r if k.endswith("/up")}):
            if (up := sum(r.get(key, 0) for r in steps)) < len(steps):
                print(f"{run.name}: {key} {up:.0f} of {len(steps)} steps")


def success(run: Path, when: str) -> tuple[float, float] | None:
    for r in records(run, "eval"):
        if r["when"] == when:
            return r["eval/success"], r["eval/success_stderr"]
    return None


def learning(args: argparse.Namespace) -> None:
    out = args.out / "learning"
    common = ["--eval-episodes", str(args.eval_episodes), "--eval-every", "1000",
              "--checkpoint-every", "1000"]
    for seed in [] if args.report_only else args.seeds:
        warm = out / f"seed{seed}" / "warm"
        if success(warm, "after warm start") is None:
            train(warm, ["--seed", str(seed), "--steps", "0", "--sft-steps",
                         str(args.sft_steps), *common], args.threads)
        for arm in args.arms:
            flags = ARMS[arm]
            run = out / f"seed{seed}" / arm
            if success(run, "GRPO") is not None:
                continue
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(warm, run)
            train(run, ["--seed", str(seed), "--steps", str(args.steps), "--resume",
                        "--force-resume", *common, *flags, *args.grpo_flags], args.threads)
    arms = args.arms
    print(f"Eval success after {args.steps} GRPO steps from a shared warm start "
          f"(± binomial SE; load now {os.getloadavg()[0]:.1f}):\n")
    print("| seed | after warm start | " + " | ".join(arms) + " | "
          + " | ".join(f"{a} − K0 (in SE)" for a in arms if a != "K0") + " |")
    print("|---|" + "---:|" * (2 * len(arms)))
    rows = []  # per complete seed: the warm start's and each arm's (success, SE)
    for seed in args.seeds:
        warm = success(out / f"seed{seed}" / "warm", "after warm start")
        got = {a: found for a in arms
               if (found := success(out / f"seed{seed}" / a, "GRPO")) is not None}
        if warm is None or len(got) < len(arms):
            continue
        rows.append({"warm": warm, **got})
        print(f"| {seed} | " + " | ".join(learning_cells(rows[-1], arms)) + " |")
    if len(rows) > 1:  # the seeds' mean: independent evaluations, so SEs add in squares
        mean = {key: (sum(r[key][0] for r in rows) / len(rows),
                      math.sqrt(sum(r[key][1] ** 2 for r in rows)) / len(rows))
                for key in rows[0]}
        print("| mean | " + " | ".join(learning_cells(mean, arms)) + " |")
    keys = ["sampler/mean_logprob_gap", "sampler/kl_k3", "off_policy/capped_fraction",
            "off_policy/masked_fraction", "episodes/stale"]
    print("\nPer arm, the mean over its seeds' GRPO steps (episodes/stale: the sum):\n")
    print("| arm | " + " | ".join(k.split("/")[1] for k in keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for arm in arms:
        steps = [r for seed in args.seeds for r in records(out / f"seed{seed}" / arm, "grpo")]
        cells = []
        for key in keys:
            values = [r[key] for r in steps if key in r]
            value = (sum(values) if key == "episodes/stale" else
                     sum(values) / len(values)) if values else None
            cells.append("–" if value is None else f"{value:.3g}")
        print(f"| {arm} | " + " | ".join(cells) + " |")


def learning_cells(row: dict[str, tuple[float, float]], arms: Sequence[str]) -> list[str]:
    """The warm start's and each arm's success ± SE, then each K = 2 arm minus K = 0
    in points and in SE of the difference."""
    cells = [f"{100 * p:.1f} ± {100 * s:.1f}%" for p, s in
             [row["warm"], *(row[a] for a in arms)]]
    p0, s0 = row["K0"]
    for arm in arms:
        if arm != "K0":
            p, s = row[arm]
            cells.append(f"{100 * (p - p0):+.1f} pt ({(p - p0) / math.hypot(s, s0):+.1f})")
    return cells


def mismatch(args: argparse.Namespace) -> None:
    out = args.out / "mismatch"
    if not args.report_only:
        warm = warm_start(args)
        with servers(2, out, dtype="bfloat16") as urls:  # two: a reset one is retried
            for correction in CORRECTIONS:
                run = out / correction
                shutil.rmtree(run, ignore_errors=True)
                shutil.copytree(warm, run)
                train(run, ["--seed", str(args.seeds[0]), "--steps", str(args.steps),
                            "--resume", "--force-resume", "--eval-episodes", "16",
                            "--eval-every", "1000", "--checkpoint-every", "1000",
                            "--off-policy-correction", correction,
                            *[f for url in urls for f in ("--sampler-url", url)]],
                      args.threads)
    keys = ["sampler/mean_logprob_gap", "sampler/max_logprob_gap", "sampler/kl_k3",
            "off_policy/weight_mean", "off_policy/capped_fraction",
            "off_policy/masked_fraction"]
    print("bf16 sampler (prefixgym serve --dtype bfloat16), fp32 trainer, K = 0: the mean "
          f"over the run's GRPO steps (max for the max gap; load now "
          f"{os.getloadavg()[0]:.1f}):\n")
    print("| correction | " + " | ".join(k.split("/")[1] for k in keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for correction in CORRECTIONS:
        steps = records(out / correction, "grpo")
        cells = []
        for key in keys:
            values = [r[key] for r in steps if key in r]
            value = (max(values) if "max" in key else sum(values) / len(values)) if values else None
            cells.append("–" if value is None else f"{value:.3g}")
        print(f"| {correction} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["speed", "learning", "mismatch"])
    parser.add_argument("--out", type=Path, default=Path("runs/staleness"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    parser.add_argument("--eval-episodes", type=int, default=1000)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="the trainer's torch threads")
    parser.add_argument("--model", default="",
                        help="speed: the model of the trainer and the servers (a checkpoint "
                        "directory or .gguf file); unset: the first seed's warm start of tiny")
    parser.add_argument("--sft-steps", type=int, default=400,
                        help="the learning part's warm-start steps")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["K0", "K2", "K2-tis"],
                        help="the learning part's arms to run (processes of one seed may "
                        "run different arms at once); to report, K0 first")
    parser.add_argument("--report-only", action="store_true")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.grpo_flags = argv[cut + 1:]  # after --: flags for every GRPO run of the learning part
    if args.report_only and args.arms[0] != "K0":
        parser.error("--arms must start with K0: the others are against it")
    if args.part == "speed" and args.ks[0] != 0:
        parser.error("--ks must start with 0: the ratios are against K = 0")
    {"speed": speed, "learning": learning, "mismatch": mismatch}[args.part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
