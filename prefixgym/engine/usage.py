"""The per-phase token ledger: a thread-safe running total of `Usage`.

Every sampling and training call adds its own `Usage` here; `service.usage()` reads
the total. The ledger only adds numbers: it knows nothing of requests or caches.
"""

from __future__ import annotations

import threading

from prefixgym.types import Usage


class UsageLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = Usage()

    def add(self, usage: Usage) -> None:
        with self._lock:
            self._total = self._total + usage

    def total(self) -> Usage:
        with self._lock:
            return self._total.model_copy()

    def reset(self) -> None:
        with self._lock:
            self._total = Usage()
