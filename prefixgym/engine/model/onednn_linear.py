"""oneDNN's packed linear on the CPU: a weight reordered into the blocked layout its
kernels read (`packed_weight`), the product on it (`packed_product`), and whether an
fp32 shape's product is reproducible across thread counts (`stored_invariant`), for
`packed.py`'s layers.

fp32 results must not depend on the thread count (docs/architecture.md,
"Determinism": the engine's tuner picks counts by timing, and a run may resume on
another `--num-threads`), which MKL guarantees in its strict mode and oneDNN does
not (on one AMD CPU, one-row products of width >= 2,048 onto <= 128 outputs summed
otherwise on 2 threads than on 1). So each fp32 shape is first run at 1 to 64 rows
on every count of `thread_counts()` (1, 2, 4, ... and the CPU count: the same set
whatever the run's own count) and stays on `F.linear` unless all give the same bits.
bf16 runs in oneDNN either way. The answer depends on the shape and the machine, not
on the weights, and a large head's check is dear (Gemma 3's 262k x 640 took 2-4 s
of a 5 s load): each answer is kept in `$PREFIXGYM_CACHE_DIR` (else
`$XDG_CACHE_HOME/prefixgym`, else `~/.cache/prefixgym`), file `VERDICTS_FILE`,
under a key naming torch's build, the CPU (model, instruction sets, count), the
thread counts and the rows checked, so a later process on the same machine and
torch reads it instead of running it again; another CPU or torch checks afresh. A
store that cannot be read or written only costs the check.

Knows torch's oneDNN ops and the cache directory; nothing of models.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import threading
from pathlib import Path

import torch

from prefixgym.engine.model.wide_ops import wide
from prefixgym.files import cache_root, write_text_atomically

__all__ = ["CHECKED_ROWS", "PACK_ROWS", "VERDICTS_FILE", "packed_product", "packed_weight",
           "stored_invariant", "thread_counts", "verdicts_path"]

PACK_ROWS = 32
"""The row count oneDNN lays the weight out for (any count runs on it)."""
CHECKED_ROWS = (1, 2, 3, 5, 8, 13, 32, 64)
"""Row counts at which an fp32 shape must give the same bits on every thread count."""
VERDICTS_FILE = "packed-thread-checks.json"
"""The file under the cache directory that keeps the thread checks' answers."""

_mkldnn = torch.ops.mkldnn
_invariant: dict[tuple[int, int, torch.dtype, bool, tuple[int, ...]], bool] = {}
_invariant_lock = threading.Lock()
_stored: dict[Path, dict[str, bool]] = {}  # each store file's answers, read once
_stored_lock = threading.Lock()


def thread_counts() -> tuple[int, ...]:
    """The thread counts an fp32 shape must agree on to be packed: the powers of two
    below the CPU count, and the CPU count."""
    cpus = os.cpu_count() or 1
    return tuple(sorted({1 << i for i in range(cpus.bit_length()) if 1 << i < cpus} | {cpus}))


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered into oneDNN's layout, on one thread. The reorder is a copy; in
    a process whose OpenMP started with its default wait policy (torch imported before
    prefixgym, which sets `OMP_WAIT_POLICY=PASSIVE`), 120 of SmolLM2's linears took
    0.96-1.8 s on 2 threads and 0.33-0.39 s on 1 (2026-12-07, Xeon, 2 cores); under
    PASSIVE, 0.17-0.29 s either way. The same bits (it moves values, it adds none)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    finally:
        torch.set_num_threads(before)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    with wide():  # (every thread, in a narrow decode step: wide_ops.py)
        return _mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _thread_invariant(weight: torch.Tensor, bias: torch.Tensor | None,
                      counts: tuple[int, ...]) -> bool:
    """Whether oneDNN's packed product of `weight`'s shape gives the same bits on every
    thread count of `counts` at `CHECKED_ROWS` rows (once per shape and process)."""
    out_features, in_features = weight.shape
    key = (in_features, out_features, weight.dtype, bias is not None, counts)
    with _invariant_lock:
        if key not in _invariant:
            packed = packed_weight(weight)
            generator = torch.Generator().manual_seed(0)
            before = torch.get_num_threads()
            same = True
            try:
                for rows in CHECKED_ROWS:
                    x = torch.randn(rows, in_features, generator=generator).to(weight.dtype)
                    outs = []
                    for count in counts:
                        torch.set_num_threads(count)
                        outs.append(packed_product(x, packed, bias))
                    same = same and all(torch.equal(outs[0], o) for o in outs[1:])
            finally:
                torch.set_num_threads(before)
            _invariant[key] = same
        return _invariant[key]


def verdicts_path() -> Path:
    """The file that keeps the thread checks' answers (the module doc)."""
    return cache_root() / VERDICTS_FILE


@functools.cache
def _machine() -> str:
    """What an answer depends on besides the shape: torch's build (and the oneDNN in
    it), the CPU's model and instruction sets, and its core count."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        cpu = "".join(dict.fromkeys(lines))  # (every core repeats the same two lines)
    except OSError:
        pass
    facts = f"{torch.__version__} {torch.version.git_version} {platform.machine()} {cpu}"
    return hashlib.sha256(facts.encode()).hexdigest()[:16] + f"-{os.cpu_count()}"


def stored_invariant(weight: torch.Tensor, bias: torch.Tensor | None,
                      counts: tuple[int, ...]) -> bool:
    """`_thread_invariant`, its answer read from the store when a process on this
    machine and torch already checked the shape, else checked and stored."""
    out_features, in_features = weight.shape
    key = (f"{_machine()} {in_features}x{out_features} {weight.dtype} bias={bias is not None}"
           f" counts={','.join(map(str, counts))} rows={','.join(map(str, CHECKED_ROWS))}"
           f" pack={PACK_ROWS}")
    path = verdicts_path()
    with _stored_lock:
        if path not in _stored:
            _stored[path] = _read_store(path)
        if key in _stored[path]:
            return _stored[path][key]
    answer = _thread_invariant(weight, bias, counts)
    with _stored_lock:
        stored = {**_read_store(path), key: answer}  # (another process may have added some)
        _stored[path] = stored
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, json.dumps(stored, indent=0, sort_keys=True))
        except OSError:
            pass  # a store that cannot be written costs the next process the check only
    return answer


def _read_store(path: Path) -> dict[str, bool]:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, unreadable or torn: the checks run again
    if not isinstance(stored, dict):
        return {}
    return {k: v for k, v in stored.items() if isinstance(k, str) and isinstance(v, bool)}
