"""`prefixgym bench NAME [ARGS]`: run one of the benchmarks in the checkout's bench/.

Benchmarks live beside the package (bench/bench_NAME.py), not inside it: they need a
source checkout and compare against peers (HF transformers, the engine with its
cache off) that a user install does not need. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def available() -> list[str]:
    if not BENCH_DIR.is_dir():
        return []
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: prefixgym bench NAME [ARGS]\n\nbenchmarks: "
              + (", ".join(names) or f"none (no bench/ directory at {BENCH_DIR})"))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"prefixgym bench: no benchmark {name!r}; available: {', '.join(names) or 'none'}",
              file=sys.stderr)
        return 2
    sys.argv = [f"bench_{name}.py", *rest]
    sys.path.insert(0, str(BENCH_DIR))
    try:
        runpy.run_path(str(BENCH_DIR / f"bench_{name}.py"), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0
