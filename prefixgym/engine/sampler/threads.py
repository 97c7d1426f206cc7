"""How many intra-op threads each engine forward gets, chosen by timing it.

On CPU, a forward of a few rows is hundreds of small ops. With sleeping OpenMP workers
(`OMP_WAIT_POLICY=PASSIVE`, which `run.sh` sets because spinning workers stall badly
on a shared machine), each parallel op first wakes them: tens of microseconds per op.
A decode step of 1-8 rows then runs 1.5-3x faster on one thread, while a long prefill
wants every core; where the line falls depends on the machine, its load, the dtype
and the wait policy. So `ThreadTuner` measures instead of guessing: per kind of step
(a key such as ("decode", rows bucket)), it times each candidate thread count a few
times, in seconds per unit of work (steps in one key vary in size), then runs the one
with the least time (noise only ever adds), and measures again every `explore_every`
uses, because load changes. The largest count is measured first, and a step that takes
it longer than `explore_below` seconds every time is not tried on fewer threads at all:
waking workers costs a few milliseconds per step at most, so only short steps can win,
and 1-thread trials of a big prefill would cost more than tuning could ever save. A
first call of a new shape can be slow (kernel setup), which is why no decision rests
on one sample.

`torch.set_num_threads` sets the calling thread's OpenMP and MKL counts, which other
threads that already ran torch keep their own of, and the process default, which a
thread takes when it first runs torch. So the engine's choices never reach a training
step already running in another thread; a thread started while an engine step runs
would inherit them, which is why the training client's worker sets its creator's
count when it starts (tests/engine/sampler/test_threads.py checks both). The count is
restored after each step. `LocalService(thread_tuning=False)` turns tuning off.

For an fp32 model the choices change speed only, not results: MKL, which picks its
matmul kernels by thread count, runs in its strict reproducible mode (`MKL_CBWR`, set
by `import prefixgym`), so a step gives the same bits on any count (docs/architecture.md,
"Determinism"). A bf16/fp16 model's matmuls run in oneDNN, which rounds by thread
count: a deterministic engine of one does not tune (`EngineService`).

This module knows nothing of models or requests: it maps keys to thread counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["ThreadTuner", "size_bucket"]


def size_bucket(n: int) -> int:
    """The power of two at or above `n` (n >= 1): sizes that cost alike share a key."""
    return 1 << max(0, n - 1).bit_length()


def _candidates(max_threads: int) -> list[int]:
    counts = {max_threads}
    n = 1
    while n < max_threads:
        counts.add(n)
        n *= 2
    return sorted(counts)


class ThreadTuner:
    """Chooses a thread count per key by timing; see the module docstring."""

    def __init__(
        self,
        max_threads: int | None = None,
        trials: int = 3,
        explore_every: int = 500,
        explore_below: float = 0.01,
        *,
        enabled: bool = True,
        get_threads: Callable[[], int] = torch.get_num_threads,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        max_threads = get_threads() if max_threads is None else max_threads
        if max_threads < 1 or trials < 1 or explore_every < 1 or not explore_below > 0:
            raise ValueError(
                f"max_threads, trials and explore_every must be >= 1 and explore_below > 0, "
                f"got {max_threads}, {trials}, {explore_every}, {explore_below}"
            )
        self.enabled = enabled
        self.candidates = _candidates(max_threads)
        self.trials = trials
        self.explore_every = explore_every
        self.explore_below = explore_below
        self._get, self._set, self._clock = get_threads, set_threads, clock
        self._samples: dict[Hashable, dict[int, list[tuple[float, float]]]] = {}
        self._best: dict[Hashable, int] = {}
        self._uses: dict[Hashable, int] = {}

    def _fresh(self, key: Hashable) -> dict[int, list[tuple[float, float]]]:
        self._samples[key] = {n: [] for n in self.candidates}
        return self._samples[key]

    def choose(self, key: Hashable) -> int:
        """The thread count the next step of this kind runs with."""
        if key in self._best:
            return self._best[key]
        samples = self._samples.get(key) or self._fresh(key)
        # all threads first (the usual choice), then the others, fewest samples first
        pending = [n for n in reversed(self.candidates)
                   if n in samples and len(samples[n]) < self.trials]
        if pending:
            most = self.candidates[-1]
            return most if most in pending else min(pending, key=lambda n: len(samples[n]))
        # settled: the least time per unit of work (noise only adds)
        self._best[key] = min(samples, key=lambda n: min(s / w for s, w in samples[n]))
        return self._best[key]

    def record(self, key: Hashable, threads: int, seconds: float, work: float = 1.0) -> None:
        """Note that a step of this kind with `work` units took `seconds` on `threads`."""
        samples = self._samples.get(key) or self._fresh(key)
        if threads in samples and len(samples[threads]) < self.trials:
            samples[threads].append((seconds, work))
            measured = samples[threads]
            if (threads == self.candidates[-1] and len(measured) == self.trials
                    and min(s for s, _ in measured) > self.explore_below):
                for n in [n for n in samples if n != threads]:
                    del samples[n]  # a long step: fewer threads cannot win
        self._uses[key] = self._uses.get(key, 0) + 1
        if self._uses[key] >= self.explore_every:  # measure again: the load may have changed
            self._uses[key] = 0
            self._best.pop(key, None)
            self._fresh(key)

    def best(self) -> dict[Hashable, int]:
        """The settled choices so far, by key (for stats and tests)."""
        return dict(self._best)

    @contextmanager
    def run(self, key: Hashable, work: float = 1.0) -> Iterator[int]:
        """Run the block on the chosen thread count (at most the current one), time it,
        restore the count. Disabled, or with one candidate, it leaves the count as is."""
        previous = self._get()
        if not self.enabled or len(self.candidates) == 1:
            yield previous
            return
        threads = min(self.choose(key), previous)  # never more than the caller has now
        if threads != previous:
            self._set(threads)
        start = self._clock()
        try:
            yield threads
        finally:
            elapsed = self._clock() - start
            if threads != previous:
                self._set(previous)
        self.record(key, threads, elapsed, work)
