"""`prefixgym estimate [train flags] [--out DIR]`: what a `prefixgym train` run will cost.

Runs a pilot of the run (`trainer.estimate.pilot_config`: a few warm-start and GRPO
steps, one evaluation batch) as `prefixgym train` would, in DIR/pilot (or a temporary
directory), then prints per part of the configured run its tokens before sharing (what the hosted
service bills), tokens computed, seconds and money, each between a low and a high bound
with what each assumes (`trainer.estimate_bounds`); with `--out DIR` also writes
DIR/estimate.json. Imports torch only once the flags are parsed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prefixgym.cli.errors import error_line
from prefixgym.cli.train_args import parse_train_config
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.estimate import ASSUMPTIONS, PILOT_GRPO_STEPS, PILOT_SFT_STEPS, Estimate
from prefixgym.trainer.estimate_bounds import MAX_LOAD_PER_CORE

ESTIMATE_DESCRIPTION = (
    "What `prefixgym train` with these flags will cost: tokens, seconds and money per part "
    "of the run (warm start, GRPO, evaluations), each a low and a high bound and the "
    "assumption behind each, extrapolated from a pilot of a few of its steps run here. --out DIR writes DIR/estimate.json (the pilot runs in DIR/pilot). "
    "Its own flags: --pilot-sft-steps N (warm-start steps of the pilot, default "
    f"{PILOT_SFT_STEPS}; 'all': the run's, for a GRPO phase sampled from the policy the run "
    f"will have), --pilot-steps N (its GRPO steps, default {PILOT_GRPO_STEPS}) and "
    "--max-load L (the highest load average the seconds' high bound allows for; default "
    f"{MAX_LOAD_PER_CORE:g} per core).")


@dataclass(frozen=True)
class PilotSize:
    sft_steps: int | None  # None: the run's own
    steps: int
    max_load: float | None = None  # None: MAX_LOAD_PER_CORE a core


def parse_estimate(argv: list[str]) -> tuple[TrainConfig, PilotSize, bool]:
    """The run to estimate, the pilot's size, and whether --out was given; a bad flag
    exits with a usage error (code 2)."""
    pilot = argparse.ArgumentParser(prog="prefixgym estimate", add_help=False)
    pilot.add_argument("--pilot-sft-steps", default=str(PILOT_SFT_STEPS))
    pilot.add_argument("--pilot-steps", type=int, default=PILOT_GRPO_STEPS)
    pilot.add_argument("--max-load", type=float, default=None)
    sizes, rest = pilot.parse_known_args(argv)
    config = parse_train_config(rest, "prefixgym estimate", ESTIMATE_DESCRIPTION)
    sft = sizes.pilot_sft_steps
    if not (sft == "all" or sft.isdigit() and int(sft) > 0) or sizes.pilot_steps < 1:
        pilot.error("--pilot-sft-steps must be a positive integer or 'all', and "
                    "--pilot-steps a positive integer")
    if sizes.max_load is not None and not sizes.max_load > 0:
        pilot.error("--max-load must be a positive load average")
    return (config, PilotSize(None if sft == "all" else int(sft), sizes.pilot_steps,
                              sizes.max_load),
            any(a == "--out" or a.startswith("--out=") for a in rest))


def run_estimate(config: TrainConfig, size: PilotSize, out_given: bool) -> int:
    """Estimate `config` as the command does: an error is one line and code 2."""
    try:
        if config.resume:
            raise ValueError("--resume: estimate prices a run from its start; run it without")
        out = Path(config.out) if out_given else None
        if out is None:
            with tempfile.TemporaryDirectory(prefix="prefixgym-pilot-") as tmp:
                estimate = pilot_and_extrapolate(config, size, Path(tmp))
        else:
            estimate = pilot_and_extrapolate(config, size, out / "pilot")
    except (ValueError, OSError) as e:
        print(f"prefixgym estimate: {error_line(e)}", file=sys.stderr)
        return 2
    pilot = estimate.pilot
    print(f"\nprefixgym estimate: {config.env}, {config.model}, from a pilot of "
          f"{pilot['sft_steps']} warm-start and {pilot['steps']} GRPO steps and "
          f"{pilot['evaluations']} evaluation(s) of {pilot['eval_episodes']} episodes "
          f"({pilot['wall_s']:.0f} s)\n")
    print(estimate.table())
    if estimate.prices is not None:
        print(f"\nmoney at the rates of {estimate.prices.model} ({estimate.price_note}); "
              f"source: {estimate.prices.source}")
    print(f"\nthe pilot ran at a load average of {pilot['load']:.1f} on {pilot['cores']} "
          f"cores; the high bounds allow for {pilot['max_load']:g} (--max-load); "
          "assumptions:")
    for line in ASSUMPTIONS:
        print(f"- {line}")
    if pilot["sft_steps"] < config.sft_steps:
        warm = next(p for p in estimate.parts if p.name == "warm_start")
        print(f"\nnote: GRPO and the evaluations were sampled from a policy warmed for "
              f"{pilot['sft_steps']} of the run's {config.sft_steps} warm-start steps (it won "
              f"{pilot['success']:.0%} of its last evaluation's episodes), so their high "
              "bounds share only as much as that policy did. For bounds from the run's own "
              "warm start, add --pilot-sft-steps all (the pilot then runs the whole warm "
              f"start, about {warm.seconds[0]:,.0f} s).")
    if out is not None:
        path = out / "estimate.json"
        path.write_text(json.dumps(estimate.to_json(), indent=2) + "\n")
        print(f"\nestimate: {path}")
    return 0


def pilot_and_extrapolate(config: TrainConfig, size: PilotSize, pilot_dir: Path) -> Estimate:
    """Run the pilot of `config` in `pilot_dir`; the `Estimate` of the whole run."""
    from prefixgym.cli.train import build_run
    from prefixgym.pricing import run_prices
    from prefixgym.trainer.estimate import TRACE, extrapolate, pilot_config
    from prefixgym.trainer.estimate_bounds import load_factors
    from prefixgym.trainer.report import MetricsLog

    prices, note = run_prices(config.model, config.price_model, config.prices)
    pilot = pilot_config(config, str(pilot_dir), size.sft_steps, size.steps)
    print(f"pilot: {pilot.sft_steps} warm-start steps, {pilot.steps} GRPO steps, evaluations "
          f"of {pilot.eval_episodes} episodes, in {pilot_dir}", file=sys.stderr)
    t0 = time.perf_counter()
    run, _ = build_run(pilot)
    run.run()
    wall = time.perf_counter() - t0
    load, cores = os.getloadavg()[0], os.cpu_count() or 1  # the pilot's last minute
    factors = load_factors(load, cores, size.max_load)
    records = MetricsLog(pilot_dir / "metrics.jsonl").read()
    trace = MetricsLog(pilot_dir / TRACE).read()  # JSON lines, read alike
    parts = extrapolate(config, records, trace, factors)
    in_parts = sum(float(r.get("time/step_s", 0.0)) + float(r.get("time/eval_s", 0.0))
                   for r in records)
    evals = [r for r in records if r.get("phase") == "eval"]
    return Estimate(config, parts, max(wall - in_parts, 0.0), pilot={
        "sft_steps": pilot.sft_steps, "steps": pilot.steps, "evaluations": len(evals),
        "eval_episodes": pilot.eval_episodes, "wall_s": round(wall, 1),
        "success": float(evals[-1]["eval/success"]) if evals else 0.0,
        "load": round(load, 2), "cores": cores,
        "max_load": size.max_load or MAX_LOAD_PER_CORE * cores,
        "dir": os.fspath(pilot_dir)}, prices=prices, price_note=note, load=factors)
