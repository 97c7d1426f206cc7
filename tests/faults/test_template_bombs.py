"""A hostile chat template cannot take the machine: constant expressions that would
build gigabytes (string and list repetition, a materialised range, nested joins, a
filter or format width given as a literal) are never computed in the prefixgym process.
`lint template` reports PG113 and exits 1; `train --model DIR` whose checkpoint holds
such a template exits 2 with one line. Both run in a child process whose own peak
memory is read back: the render worker, which does compute them, is capped at 512 MiB
and dies alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from faultkit import TINY, hf_dir

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the memory cap and /proc/self/status are Linux's")

# Each builds 2.4-3 GB: far over the worker's cap and the caller's budget, and under
# the cap put on the child, so that one computed in the caller shows in its peak
# instead of failing quietly (jinja2 gives up folding an expression that raises).
BOMBS = {
    "string": "{{ 'x' * 3 * 10**9 }}",
    "list": "{{ ([0] * 3 * 10**8) | length }}",
    "range": "{{ ((range(100000) | list) * 3000) | length }}",
    "joins": "{{ (['x' * 1000000] * 3000) | join }}",
    "filter": "{{ 'x' | center(3000000000) }}",
    "format": "{{ '%03000000000d' % 1 }}",
}
CALLER_PEAK_MIB = 600
"""What the calling process may reach (it holds transformers and, for train, torch and a
tiny model); a bomb computed in it would take gigabytes."""

# Runs each command in one child (its imports paid once), capturing what it prints, then
# reports the child's own peak resident memory. The child's address space is capped, so
# a bomb that escapes is a MemoryError there, not the machine's memory.
CHILD = """
import contextlib, io, json, resource, sys
def peak():  # VmHWM: this image's own peak (ru_maxrss carries the parent's over fork+exec)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) // 1024
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))
from prefixgym.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    results.append({"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "peak_mib": peak()})
print(json.dumps({"results": results, "peak_mib": peak()}))
"""


def run_child(commands: list[list[str]], cwd: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(commands)], cwd=cwd,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_no_template_bomb_is_computed_in_the_caller(tmp_path: Path) -> None:
    commands = []
    for name, template in BOMBS.items():
        (tmp_path / f"{name}.jinja").write_text(template)
        commands.append(["lint", "template", f"{name}.jinja"])
    model = hf_dir(tmp_path / "model")
    (model / "chat_template.jinja").write_text(BOMBS["joins"])
    commands.append(["train", "--model", str(model), "--out", str(tmp_path / "run"), *TINY])

    report = run_child(commands, tmp_path)
    *lints, train = report["results"]
    for name, lint in zip(BOMBS, lints):
        assert lint["rc"] == 1, (name, lint)
        assert "PG113 error" in lint["out"] and "rendering exceeded a limit" in lint["out"], \
            (name, lint["out"])
    assert train["rc"] == 2, train
    err = train["err"].strip()
    assert err.startswith("prefixgym train: --model ") and "\n" not in err, err
    assert "its chat template cannot be used: chat template: rendering exceeded a limit" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert report["peak_mib"] < CALLER_PEAK_MIB, [r["peak_mib"] for r in report["results"]]
