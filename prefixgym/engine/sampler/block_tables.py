"""A sequence's block tables: the blocks it takes, shares, drops and frees.

A `Continuation` keeps one table per group of the pool's layout (kv_pool.py's
`PageLayout`): `table` for the first group (every layer, or a hybrid model's full
attention layers) and `window_tables` for a hybrid model's windowed groups. A block of
positions takes one block in each; the request's samples share their prompt's full
blocks in every group and copy a part-filled last one.

A model whose every layer has a sliding window never reads a position again once the
next query is a window past it: before each decode step a sequence drops the blocks
that fell out of it, first indexing them in the cache (a later turn that extends the
conversation still hits them while they stay cached), then releasing its references
(the table keeps 0 there: block 0 is masked padding). It drops them only while the
block after them is not one the cache indexes, which would leave a referenced entry
under an unreferenced parent (`PrefixCache.insert`). In a hybrid model only the
windowed groups' blocks are dropped, indexed first too, and released as the least
likely to be asked for again (`release(stale=True)`); the full layers keep every block.

This module knows nothing of batches, queues or tensors: it moves block ids between
sequences and the `PrefixCache`.
"""

from __future__ import annotations

from prefixgym.engine.sampler.prefix_cache import PrefixCache
from prefixgym.engine.sampler.requests import Continuation


def new_block(cache: PrefixCache, seq: Continuation, fresh: list[int]) -> None:
    """A block of positions at the end of the sequence, one block in each group, from
    those promised to it; the never-used ones (to zero) are appended to `fresh`."""
    for table in seq.group_tables:
        seq.reserved -= 1
        block, new = cache.allocate()
        if new:
            fresh.append(block)
        table.append(block)


def share_prompt(cache: PrefixCache, first: Continuation, seq: Continuation,
                 prompt_len: int, fresh: list[int], copies: list[tuple[int, int, int]]) -> None:
    """`seq` takes references to `first`'s full prompt blocks, and a block of its own
    for a part-filled last one, whose positions it copies ((src, dst, positions) in
    `copies`)."""
    bs = cache.block_size
    seq.table = first.table[: prompt_len // bs]
    seq.window_tables = [t[: prompt_len // bs] for t in first.window_tables]
    seq.dropped = first.dropped
    cache.acquire(seq.blocks())
    if prompt_len % bs:
        new_block(cache, seq, fresh)
        for src, dst in zip(first.group_tables, seq.group_tables):
            copies.append((src[-1], dst[-1], prompt_len % bs))


def drop_outside_window(cache: PrefixCache, seq: Continuation, window: int) -> int:
    """Index, then release, the sequence's blocks every position of which lies at or
    before its next query's position minus `window` (no windowed layer reads them
    again): all its blocks, or in a hybrid pool its windowed groups' ones. The number of
    blocks of positions dropped."""
    bs = cache.block_size
    dead = min((seq.kv_len - window + 1) // bs, len(seq.table))
    hybrid = bool(seq.window_tables)
    if dead <= seq.dropped or (not hybrid and dead < len(seq.table)
                               and cache.is_indexed(seq.table[dead])):
        return 0
    req = seq.request
    cache.insert(req.prompt + seq.tokens, req.version, seq.table, dead * bs, finished=False,
                 window_tables=seq.window_tables)
    for table in seq.window_tables if hybrid else [seq.table]:
        cache.release(table[seq.dropped : dead], stale=hybrid)
        table[seq.dropped : dead] = [0] * (dead - seq.dropped)
    dropped, seq.dropped = dead - seq.dropped, dead
    return dropped


def free(cache: PrefixCache, seq: Continuation) -> None:
    """Drop the sequence's references and promises."""
    cache.release(seq.blocks())
    cache.unreserve(seq.reserved)
    seq.table, seq.window_tables, seq.reserved = [], [], 0
