"""Lines of the sampling path (the engine files a `sample()` passes through), per file.

Issue 13 asks that the path be at most 900 lines. Two counts per file: every line, and
code lines (without blank lines, comment-only lines, and docstrings of the module, its
classes and functions). With `--peer DIR`, the same counts for another checkout (e.g.
/work/main) side by side, and the ratio of the totals. Run by hand:

    .venv/bin/python bench/count_sampling_path.py --peer /work/main
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path

FILES = ("engine.py", "scheduler.py", "batch.py", "runner.py", "kv_pool.py",
         "prefix_cache.py", "block_manager.py", "requests.py", "sampling.py")
"""Under prefixgym/engine/sampler/ (older checkouts: prefixgym/engine/); batch.py and
block_manager.py came out of scheduler.py and prefix_cache.py. A file a checkout lacks
counts 0."""
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
             tokenize.DEDENT, tokenize.ENDMARKER}


def count(tree: Path, name: str) -> tuple[int, int]:
    """(lines, code lines) of one file of the sampling path in `tree`."""
    found = [p for p in (tree / "prefixgym" / "engine" / "sampler" / name,
                         tree / "prefixgym" / "engine" / name) if p.is_file()]
    if not found:
        return 0, 0
    source = found[0].read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(source.splitlines()), len(code - docstrings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]),
                        help="checkout to count (default: this one)")
    parser.add_argument("--peer", default=None, help="another checkout, counted alongside")
    args = parser.parse_args()
    trees = [Path(args.tree)] + ([Path(args.peer)] if args.peer else [])
    counts = [[count(t, f) for f in FILES] for t in trees]
    print(f"{'file':16}" + "".join(f"{str(t)[-28:]:>30}" for t in trees))
    for i, name in enumerate(FILES):
        print(f"{name:16}" + "".join(f"{c[i][0]:>18} lines {c[i][1]:>5}" for c in counts))
    totals = [(sum(a for a, _ in c), sum(b for _, b in c)) for c in counts]
    print(f"{'total':16}" + "".join(f"{a:>18} lines {b:>5}" for a, b in totals))
    if len(totals) == 2:
        print(f"tree / peer: {totals[0][0] / totals[1][0]:.3f} of lines, "
              f"{totals[0][1] / totals[1][1]:.3f} of code lines")


if __name__ == "__main__":
    main()
