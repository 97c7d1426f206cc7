"""The `prefixgym` command: train | rollout | demo | lint | serve | proxy | bench.

Every entry point of prefixgym lives in this package, one module per command: it
parses flags, builds the services and clients (`LocalService`, the OpenAI sampling
client), and hands them to the layers below, which never build their own. Each
subcommand is imported lazily, so `prefixgym lint ...` never pays for loading torch.
`python -m prefixgym COMMAND` is the same command.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

USAGE = """usage: prefixgym COMMAND [ARGS]

commands:
  train     SFT warm start + GRPO on an env or an agent program (the main job)
  estimate  what a train run will cost (tokens, seconds, money per part), from a short pilot
  rollout   sample episodes of an env, print transcripts and cache hits
  demo      a short multi-turn sampling demo that prints the usage ledger
  lint      find what makes prompts miss the prefix cache (template | trace | env)
  serve     expose the built-in engine over an OpenAI-compatible HTTP API
  proxy     record agent programs' calls, token for token, in front of another server
  bench     run a benchmark from bench/

Run `prefixgym COMMAND --help` for the options of one command.
"""


def _train(argv: list[str]) -> int:
    from prefixgym.cli.train_args import parse_train_args

    config, pretrained = parse_train_args(argv)  # --help and usage errors answer before torch
    from prefixgym.cli.train import run_command

    return run_command(config, pretrained)


def _estimate(argv: list[str]) -> int:
    from prefixgym.cli.estimate import parse_estimate, run_estimate

    return run_estimate(*parse_estimate(argv))  # --help answers before torch loads


def _rollout(argv: list[str]) -> int:
    from prefixgym.cli.rollout import main

    return main(argv)


def _demo(argv: list[str]) -> int:
    from prefixgym.cli.demo import main

    return main(argv)


def _lint(argv: list[str]) -> int:
    from prefixgym.cli.lint import main

    return main(argv)


def _serve(argv: list[str]) -> int:
    from prefixgym.cli.serve import main

    return main(argv)


def _proxy(argv: list[str]) -> int:
    from prefixgym.cli.proxy import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from prefixgym.cli.bench import main

    return main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _train,
    "estimate": _estimate,
    "rollout": _rollout,
    "demo": _demo,
    "lint": _lint,
    "serve": _serve,
    "proxy": _proxy,
    "bench": _bench,
}


def _one_line(name: str, show: Any) -> Any:
    """prefixgym's own warnings as one line, `prefixgym COMMAND: warning: MESSAGE` (not
    Python's two, with a source line); others as Python shows them."""
    def show_warning(message: Warning | str, category: type[Warning], filename: str,
                     lineno: int, file: Any = None, line: str | None = None) -> None:
        if f"{os.sep}prefixgym{os.sep}" in filename:
            print(f"prefixgym {name}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)
    return show_warning


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"prefixgym: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    warnings.showwarning = _one_line(name, warnings.showwarning)
    try:
        return command(rest)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("prefixgym"):
            print(f"prefixgym {name}: not available in this version ({e.name})", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
