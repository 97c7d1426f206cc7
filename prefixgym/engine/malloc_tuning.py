"""glibc's mmap threshold, fixed for training: freed activations go back to the system.

torch's CPU tensors come from the C library's malloc. glibc serves a request of at
least `M_MMAP_THRESHOLD` bytes (128 KiB when a process starts) with a mapping of its
own, returned to the system on free. That threshold is dynamic by default: each free
of such a mapping raises it to the mapping's size, up to 32 MiB on 64-bit. After the
first training chunk, activations of up to 32 MiB (a 512-position MLP activation of a
0.5B model is 10 MiB) come from malloc's arenas instead, and the holes they leave
when freed stay resident: the training worker's arena grows with every datum while
the live tensors do not. On a 2-layer model of Qwen2-0.5B's widths (LoRA, 4 x 512
positions, activations recomputed) the peak RSS rose 461 MiB over the loaded model
with the dynamic threshold, of which 231 MiB were free bytes held by the arenas, and
244 MiB with it fixed (2 MiB held); see docs/benchmarks.md.

1) `fix_mmap_threshold()` sets `M_MMAP_THRESHOLD` to `MMAP_THRESHOLD_BYTES` (glibc's
   own start value) once per process, which also turns the dynamic adjustment off.
   A `TrainingClient` with `recompute_activations` calls it at its first
   forward_backward. Later calls return the first call's answer.
2) `release_free_memory()` hands the free bytes malloc holds back to the system
   (`malloc_trim(0)`), for the end of a phase that freed many temporaries:
   `load_hf_checkpoint` calls it. Loading Qwen2-0.5B's shapes (2 GB of fp32 weights)
   left 350 MiB of freed checks and copies resident in the main arena until then.
   `release_free_memory_later()` runs it on a thread of its own, at most one at a
   time, for a caller that should not wait: every publish, whose trim handed back the
   0.3-1.6 GB a GRPO step of SmolLM2-135M freed in 0.02-0.4 s (median 0.2 s, a third
   of the publish; glibc locks one arena at a time while it trims it, and ctypes lets
   go of the GIL).
3) Both leave the setting alone where the user chose one (glibc reads the environment
   variable `MALLOC_MMAP_THRESHOLD_` at start) and is a no-op where the C library is
   not glibc (macOS, musl, Windows): they return False there.

The cost: a mapping per large allocation (a page fault per 4 KiB touched) instead of
reusing arena memory. On the tiny preset (8 x 512 fp32 steps) it added about 2 s of
system time to a 3.5 s step: small models compute little per byte allocated. That is
why it belongs to the opt-in memory option, not the default path; figures in
docs/benchmarks.md. This module knows ctypes and glibc only; not torch or models.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
import threading

__all__ = ["ENV_VAR", "MMAP_THRESHOLD_BYTES", "fix_mmap_threshold", "release_free_memory",
           "release_free_memory_later"]

M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's start value; fixing it there stops the dynamic growth to 32 MiB."""
ENV_VAR = "MALLOC_MMAP_THRESHOLD_"
"""glibc's own tunable: when set, the user's choice stands and nothing is changed."""

_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet in this process
_release: threading.Thread | None = None  # the trim `release_free_memory_later` started last


def glibc() -> ctypes.CDLL | None:
    """The process's glibc, or None where the C library is another one."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = _c_library_name()
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


@functools.cache
def _c_library_name() -> str:
    """Looked up once: `find_library` runs `ldconfig -p` in a child process (40-130 ms
    here, which every publish paid through `release_free_memory`)."""
    return ctypes.util.find_library("c") or "libc.so.6"


def fix_mmap_threshold() -> bool:
    """Steps 1 and 3: fix glibc's mmap threshold at 128 KiB, once per process. True when
    this process's malloc now runs with it (set here or by an earlier call)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get(ENV_VAR):
        return False  # the user's setting, read by glibc at start, stands
    libc = glibc()
    if libc is None:
        return False
    # both arguments and the result are C ints, ctypes' defaults; glibc answers 1 on success
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release_free_memory() -> bool:
    """Step 2: return malloc's free bytes to the system. True when glibc ran the trim
    (whether or not it found anything to return); False without glibc."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def release_free_memory_later() -> threading.Thread | None:
    """Step 2 on a daemon thread: the thread running a trim, started here unless the
    last one started is still running (then that one: trims do not queue up). None,
    and no thread, without glibc."""
    global _release
    if glibc() is None:
        return None
    with _lock:
        if _release is None or not _release.is_alive():
            # the module's name is looked up when the thread runs (a caller may replace it)
            _release = threading.Thread(target=lambda: release_free_memory(), daemon=True,
                                        name="prefixgym-malloc-trim")
            _release.start()
        return _release
