"""Narrow steps, wide ops: a decode step's small ops on one thread, its matmuls and
attention on the step's thread count.

Once two Python threads of a process have run torch ops (the engine's beside the
caller's, a trainer's worker), libgomp manages more threads than there are cores and
cuts its spin-wait to almost nothing, whatever `OMP_WAIT_POLICY` says: every parallel
op then wakes a sleeping worker and waits for it. On the 2-core VMs measured that is
~60-80 us an op, against ~12 us for an add of 128 x 768 on one thread. A decode step is
a few hundred such ops (norms, RoPE, residual adds, the KV writes, the shared-key
merge) around a few dozen that do need every core: the linears and attention.

`narrow(threads)` runs a block (a forward) on one torch thread, and inside it `wide()`
runs its own block on `threads`; outside `narrow`, `wide()` changes nothing. The state
is the calling thread's: a trainer in another thread is untouched. Elementwise ops give
the same bits on any thread count, and the wide ops run on the count they would have
had, so a narrow step's results are a wide one's, bit for bit (fp32 and bf16 alike).

Knows torch's thread count only; `packed.py` says which models may run narrow (every
linear of theirs goes through `wide()`), the sampler's runner decides when.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["narrow", "wide"]


class _State(threading.local):
    wide = 0
    """The count `wide()` runs on in this thread (0: not in a narrow block)."""
    inside = False
    """Whether this thread is in a `wide()` block."""


_state = _State()


@contextmanager
def narrow(threads: int) -> Iterator[None]:
    """Run the block on one torch thread, its `wide()` blocks on `threads` (1: as is)."""
    if threads <= 1 or _state.wide:
        yield
        return
    before = torch.get_num_threads()
    _state.wide = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _state.wide = 0
        torch.set_num_threads(before)


@contextmanager
def wide() -> Iterator[None]:
    """Inside `narrow(n)`: run the block on n threads. Elsewhere: nothing."""
    threads = _state.wide
    if not threads or _state.inside:  # (nested: already wide)
        yield
        return
    _state.inside = True
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)
        _state.inside = False
