"""The per-phase ledger: a thread-safe running total of `Usage`, and of seconds.

Every sampling and training call adds its own `Usage` here; `service.usage()` reads
the total. The engine thread adds the seconds of each of its forwards, by kind
(`prefill`, `decode`), and the trainer's worker those of its calls
(`forward_backward`, `optim_step`, `publish`); `service.seconds()` reads them. The
ledger only adds numbers: it knows nothing of requests or caches.
"""

from __future__ import annotations

import threading

from prefixgym.types import Usage

SECONDS_PHASES = ("prefill", "decode", "forward_backward", "optim_step", "publish")
"""The phases whose seconds the engine and the trainer time (`UsageLedger.seconds`)."""


class UsageLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = Usage()
        self._seconds = dict.fromkeys(SECONDS_PHASES, 0.0)

    def add(self, usage: Usage) -> None:
        with self._lock:
            self._total = self._total + usage

    def add_seconds(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] += seconds

    def seconds(self) -> dict[str, float]:
        """Seconds spent per phase of `SECONDS_PHASES` so far."""
        with self._lock:
            return dict(self._seconds)

    def total(self) -> Usage:
        with self._lock:
            return self._total.model_copy()

    def reset(self) -> None:
        with self._lock:
            self._total = Usage()
            self._seconds = dict.fromkeys(SECONDS_PHASES, 0.0)
