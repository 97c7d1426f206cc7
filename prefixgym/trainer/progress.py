"""Progress of a run's long phases -- warm start, evaluations, GRPO -- one display for all.

On a terminal each phase is a tqdm bar with its running figures (loss, success,
reward, cache hit rate). Written to a file or a pipe, the same phase prints plain
lines instead -- its start, about every tenth of the way, and its end -- so a log
reads like a log rather than a run of carriage returns. Knows nothing of what is
being counted.
"""

from __future__ import annotations

import sys
import time
from typing import IO

from tqdm import tqdm


class Progress:
    """`total` units of one phase; `update(n, **figures)` after each piece of work."""

    def __init__(
        self, desc: str, total: int, unit: str, enabled: bool = True, initial: int = 0,
        stream: IO[str] | None = None,
    ) -> None:
        self.desc, self.total, self.unit, self.done = desc, total, unit, initial
        self.enabled = enabled and total > 0
        self._stream = stream if stream is not None else sys.stderr
        self._bar: tqdm[None] | None = None
        self._start = time.perf_counter()
        self._next_line = initial
        self._figures: dict[str, str] = {}
        if not self.enabled:
            return
        if self._stream.isatty():
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit,
                             file=self._stream, dynamic_ncols=True)
        else:
            self._line(f"{total - initial} {unit}s")
            self._next_line = initial + max(1, total // 10)

    def update(self, n: int = 1, **figures: str) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(figures, refresh=False)
            self._bar.update(n)
        elif self.done >= self._next_line and self.done < self.total:
            self._line(self._status(figures))
            self._next_line = self.done + max(1, self.total // 10)
        self._figures = figures

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            self._line(self._status(self._figures) + " done")
        self.enabled = False

    def _status(self, figures: dict[str, str]) -> str:
        elapsed = time.perf_counter() - self._start
        shown = ", ".join(f"{k} {v}" for k, v in figures.items())
        return f"{self.done}/{self.total} {self.unit}s, {elapsed:.0f} s" + (
            f"; {shown}" if shown else "")

    def _line(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=self._stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
