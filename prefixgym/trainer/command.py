"""`prefixgym train`: parse flags into a TrainConfig and run it."""

from __future__ import annotations

import sys

from prefixgym.config_cli import parse_config
from prefixgym.trainer.config import TrainConfig

FLAG_NAMES = {"async_mode": "async", "lr": "lr"}


def main(argv: list[str]) -> int:
    config = parse_config(
        TrainConfig, argv, prog="prefixgym train",
        description="SFT warm start on expert episodes, then GRPO, on one env; writes "
        "metrics.jsonl, report.md, plots and checkpoints to --out.",
        flag_names=FLAG_NAMES,
    )
    from prefixgym.trainer.run import train

    try:
        result = train(config)
    except ValueError as e:
        print(f"prefixgym train: {e}", file=sys.stderr)
        return 2
    print(f"report: {result.out / 'report.md'}")
    return 0
