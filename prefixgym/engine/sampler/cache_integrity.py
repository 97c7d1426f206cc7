"""The prefix cache's invariants, checked: what the tests and the scheduler's
`check_integrity` assert after any sequence of operations (prefix_cache.py's
contract). Reads the cache's private state on purpose; changes nothing."""

from __future__ import annotations

from prefixgym.engine.sampler import prefix_cache
from prefixgym.engine.sampler.prefix_cache import _ROOT, PrefixCache


def check_prefix_cache(cache: PrefixCache, refs: dict[int, int] | None = None) -> None:
    """Raise AssertionError naming the first broken invariant. `refs`: the number of
    running-sequence references to each block, as the caller counts them."""
    free = set(cache.blocks.free_list)
    _require(len(free) == len(cache.blocks.free_list), "a block is on the free list twice")
    _require(0 not in free and 0 not in cache._entry_of and cache.blocks.refs[0] == 0,
             "the padding block 0 is in use")
    for b in range(1, cache.num_blocks):
        used = cache.blocks.refs[b] > 0 or b in cache._entry_of or b in cache._window_entry_of
        never = b >= cache.blocks.next_fresh
        _require(cache.blocks.refs[b] >= 0, f"block {b} has ref_count {cache.blocks.refs[b]}")
        _require(used + (b in free) + never == 1,
                 f"block {b}: used={used} free={b in free} never-used={never}")
        if refs is not None:
            _require(cache.blocks.refs[b] == refs.get(b, 0),
                     f"block {b} counts {cache.blocks.refs[b]} references, sequences hold "
                     f"{refs.get(b, 0)}")
    _require(0 <= cache.reserved <= cache._available(),
             f"{cache.reserved} blocks reserved, {cache._available()} available")
    for key, e in cache._index.items():
        _require(e.key == key == prefix_cache._key(e.version, e.parent_key, e.tokens),
                 f"entry {key} key does not match its (version, parent, tokens)")
        _require(cache._entry_of.get(e.block) is e, f"entry {key} block map is stale")
        _require(0 < len(e.tokens) <= cache.block_size, f"entry {key} has {len(e.tokens)} tokens")
        _require((cache.blocks.refs[e.block] == 0) == (e.block in cache._lru),
                 f"entry {key} ref {cache.blocks.refs[e.block]} vs LRU membership")
        _require(cache._children.get(e.parent_key, {}).get(key) is e,
                 f"entry {key} missing from its parent's children")
        if e.parent_key != _ROOT:
            parent = cache._index.get(e.parent_key)
            _require(parent is not None, f"entry {key} has an evicted parent")
            assert parent is not None
            _require(len(parent.tokens) == cache.block_size, f"entry {key} under a partial block")
            _require(parent.version == e.version, f"entry {key} version differs from its parent's")
            _require(cache.blocks.refs[e.block] == 0 or cache.blocks.refs[parent.block] > 0,
                     f"entry {key} is referenced, its parent is not (and cannot be evicted)")
    for key, e in cache._index.items():
        unreferenced = all(cache.blocks.refs[b] == 0 for b in e.window_blocks)
        _require(all(cache._window_entry_of.get(b) is e for b in e.window_blocks)
                 and len(e.window_blocks) in (0, cache.window_groups),
                 f"entry {key} window blocks {e.window_blocks} are not mapped to it")
        _require((key in cache._window_lru) == (bool(e.window_blocks) and unreferenced),
                 f"entry {key} window blocks' references vs window LRU membership")
        _require(not set(e.window_blocks) & set(cache._entry_of),
                 f"entry {key}: a window block is another entry's block")
    _require(len(cache._window_entry_of) == sum(len(e.window_blocks) for e in cache._index.values()),
             "window block map and entries differ")
    _require(len(cache._entry_of) == len(cache._index), "block map and index differ")
    _require(sum(len(c) for c in cache._children.values()) == len(cache._index),
             "children lists and index differ")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"prefix cache integrity: {message}")
