"""The prefix cache: the index of cached prefixes over the KV pool's blocks, and the
promises and evictions that keep both within the pool.

`PrefixCache` holds the pool's `BlockManager` (block_manager.py: which block ids are
free or referenced, and how often) and decides which unreferenced blocks hold a cached
prefix (the index). A block is free, referenced, or cached with no reference: then it
sits in LRU order and is evicted (least recently used leaf first, so every cached
block's parent is cached too) only when an allocation finds no free block. There are
no copies: a hit hands out the cached block ids themselves, and a finished sequence's
blocks enter the index where they are.

An index entry's key is a chained hash of (weights version, parent key, its tokens),
so a key names a whole prefix under one set of weights; every hit is verified against
the stored tokens, version and parent, never trusted to the hash alone. Keys are this
module's own: callers see block ids, token counts and an opaque `claim`. An entry holds
`block_size` tokens, or fewer for the last block of a finished sequence (a partial
block); a match continues below the block with the child that shares the longest
token prefix (`Match.tail_block`), whose positions the caller copies into a block of
its own, since a cached block is never written.

A hybrid model's pool (kv_pool.py's `PageLayout`) gives a block of positions one block
per group: the entry's own `block` for the full-attention layers and `window_blocks`
(`window_groups` of them) for the windowed ones. Those are the first to go: a running
sequence releases them once no window reads them (the scheduler), and eviction takes
them alone, leaving the entry and its chain. So a match needs them only for the blocks
the first computed position's window reaches, and ends earlier, at the longest prefix
whose last window has them all. A sequence that computes such a block again gives the
entry its window blocks (the entry keeps its own block). Eviction takes units in one
least-recently-used order, whichever is older: an entry that is a leaf (with its window
blocks), or the window blocks of any entry.

Contract -- reads (no change to refcounts, LRU order, reservations or statistics):
`match`, `can_reserve`, `is_indexed`, `stats`, `len()` (and cache_integrity.py's check). Changes: `reserve` /
`unreserve` (blocks promised to admitted sequences, so decoding never runs out),
`allocate` (takes one reserved block, evicting if needed), `acquire` / `release`
(refcounts; an unindexed block whose last reference goes is free again), `insert`
(index a sequence's blocks), `record_lookup` (statistics), `demote_version` (a stale
version's unreferenced blocks are evicted first), `drop_version`, `evict`.

The cache knows nothing of tensors, models, requests or tokenizers: it maps token
prefixes to block ids and counts references.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from prefixgym.engine.sampler.block_manager import BlockManager

_ROOT = 0  # the parent key of a chain's first block


def _key(version: int, parent_key: int, tokens: tuple[int, ...]) -> int:
    return hash((version, parent_key, tokens))


@dataclass(eq=False)
class Entry:
    """One indexed block: `tokens` are its positions' tokens (block_size, or fewer)."""

    key: int
    parent_key: int
    version: int
    tokens: tuple[int, ...]
    block: int
    window_blocks: tuple[int, ...] = ()  # the windowed groups' blocks; () once released
    stamp: int = 0  # its place in the LRU order, while unreferenced
    window_stamp: int = 0  # its window blocks' place, while they are unreferenced


@dataclass
class Match:
    """The longest cached prefix of a token list: full `blocks` (root first), then the
    first `tail_tokens` positions of `tail_block` (to copy). `claim` names the first
    full block the caller will compute (None when there is none). With window groups:
    `window_blocks[i]` are block i's windowed blocks where the first computed position's
    window reaches it, () before; `tail_window_blocks` the tail's."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    tail_block: int | None = None
    tail_tokens: int = 0
    claim: Hashable | None = None
    window_blocks: list[tuple[int, ...]] = field(default_factory=list)
    tail_window_blocks: tuple[int, ...] = ()

    def all_blocks(self) -> list[int]:
        """Every block a caller that takes this match references: blocks, window
        blocks, then the tail's."""
        tail = [] if self.tail_block is None else [self.tail_block, *self.tail_window_blocks]
        return self.blocks + [b for w in self.window_blocks for b in w] + tail


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int, block_bytes: int,
                 indexing: bool = True, window_groups: int = 0, window: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks, self.block_size, self.block_bytes = num_blocks, block_size, block_bytes
        self.indexing = indexing  # False: blocks are freed, never cached (prefix_cache=False)
        self.window_groups, self.window = window_groups, window  # a hybrid pool's
        self.blocks = BlockManager(num_blocks)
        self._index: dict[int, Entry] = {}
        self._entry_of: dict[int, Entry] = {}  # block id -> its entry
        self._children: dict[int, dict[int, Entry]] = {}  # parent key -> children (never empty)
        self._lru: OrderedDict[int, Entry] = OrderedDict()  # cached, unreferenced; LRU first
        self._window_entry_of: dict[int, Entry] = {}  # window block id -> its entry
        self._window_lru: OrderedDict[int, Entry] = OrderedDict()  # by key: window blocks unreferenced
        self._recent = itertools.count(1)  # LRU stamps: larger is more recent
        self._stale = itertools.count(-1, -1)  # ... and those put first, below every other
        self._stale_versions: set[int] = set()
        self.reserved = 0
        self.query_tokens = self.hit_tokens = 0
        self.inserted_blocks = self.evicted_blocks = 0

    # ---- reads -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def _available(self) -> int:
        return (self.blocks.unused() + len(self._lru)
                + self.window_groups * len(self._window_lru))

    def can_reserve(self, num_blocks: int, pinning: Iterable[int] = ()) -> bool:
        """Whether `num_blocks` more blocks can be promised after referencing `pinning`."""
        evictable_pinned = sum(1 for b in set(pinning) if self.blocks.refs[b] == 0 and (
            b in self._entry_of or b in self._window_entry_of))
        return self._available() - evictable_pinned - self.reserved >= num_blocks

    def match(self, tokens: Sequence[int], version: int, max_tokens: int) -> Match:
        """The longest cached prefix of `tokens[:max_tokens]`. Reads only."""
        limit, bs = min(len(tokens), max_tokens), self.block_size
        found = Match()
        if not self.indexing:
            return found
        parent = _ROOT
        chain: list[Entry] = []
        for start in range(0, limit - bs + 1, bs):
            entry = self._verified(version, parent, tuple(tokens[start : start + bs]))
            if entry is None:
                break
            chain.append(entry)
            parent = entry.key
        if self.window_groups:
            chain = self._window_hit(chain)
            parent = chain[-1].key if chain else _ROOT
        found.blocks = [e.block for e in chain]
        n = found.num_tokens = len(found.blocks) * bs
        if n + bs <= len(tokens):
            found.claim = _key(version, parent, tuple(tokens[n : n + bs]))
        rest = tokens[n:limit]
        for child in self._children.get(parent, {}).values() if rest else ():
            if child.version != version or (self.window_groups and not child.window_blocks):
                continue
            common = 0
            for a, b in zip(child.tokens, rest):
                if a != b:
                    break
                common += 1
            if common > found.tail_tokens:
                found.tail_block, found.tail_tokens = child.block, common
                found.tail_window_blocks = child.window_blocks
        found.num_tokens += found.tail_tokens
        first = self._first_in_window(found.num_tokens)
        found.window_blocks = [e.window_blocks if i >= first else ()
                               for i, e in enumerate(chain)] if self.window_groups else []
        return found

    def _first_in_window(self, position: int) -> int:
        """The first block a query at `position` (and every later one) reads in a
        windowed layer: keys (position - window, position]."""
        return max(0, position - self.window + 1) // self.block_size

    def _window_hit(self, chain: list[Entry]) -> list[Entry]:
        """The longest head of `chain` whose blocks in the window of the position after
        it all keep their window blocks (a tail can only lengthen that window's reach
        by a part block, whose window blocks the tail's own check asks for: a tail
        with positions past the last full block reads a window starting no earlier)."""
        n = len(chain)
        while n and not all(e.window_blocks for e in chain[self._first_in_window(n * self.block_size) : n]):
            n -= 1
        return chain[:n]

    def _verified(self, version: int, parent: int, tokens: tuple[int, ...]) -> Entry | None:
        entry = self._index.get(_key(version, parent, tokens))
        if entry is None or (entry.tokens, entry.version, entry.parent_key) != (
                tokens, version, parent):
            return None  # absent, or a hash collision
        return entry

    def _cached_blocks(self) -> int:
        return len(self._index) + len(self._window_entry_of)

    def generation(self) -> tuple[int, int, int]:
        """Changes whenever `match` could answer differently (an entry or a window
        block came or went)."""
        return self.inserted_blocks, self.evicted_blocks, len(self._window_entry_of)

    def is_indexed(self, block: int) -> bool:
        return block in self._entry_of

    def stats(self) -> dict[str, int]:
        return {
            "block_size": self.block_size,
            "capacity_bytes": self.num_blocks * self.block_bytes,
            "used_bytes": self._cached_blocks() * self.block_bytes,
            "num_blocks": self._cached_blocks(),
            "referenced_blocks": self._cached_blocks() - len(self._lru)
                                 - self.window_groups * len(self._window_lru),
            "running_blocks": self.blocks.running(),
            "free_blocks": self.blocks.unused(),
            "reserved_blocks": self.reserved,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "inserted_blocks": self.inserted_blocks,
            "evicted_blocks": self.evicted_blocks,
        }

    # ---- changes -----------------------------------------------------------------

    def reserve(self, num_blocks: int) -> None:
        if not self.can_reserve(num_blocks):
            raise RuntimeError(f"cannot reserve {num_blocks} blocks: check can_reserve first")
        self.reserved += num_blocks

    def unreserve(self, num_blocks: int) -> None:
        if not 0 <= num_blocks <= self.reserved:
            raise RuntimeError(f"unreserve {num_blocks} of {self.reserved} reserved blocks")
        self.reserved -= num_blocks

    def allocate(self) -> tuple[int, bool]:
        """One reserved block, referenced once: (block id, never used before -- zero it)."""
        self.unreserve(1)
        if not self.blocks.unused() and not self.evict(1):
            raise RuntimeError("no free block and no evictable one, though one was reserved")
        return self.blocks.take()

    def acquire(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.blocks.refs[b] == 0:
                if b in self._lru:
                    del self._lru[b]
                elif b in self._window_entry_of:  # its entry's window blocks leave the LRU
                    self._window_lru.pop(self._window_entry_of[b].key, None)
                else:
                    raise RuntimeError(f"acquire of block {b}, which is neither used nor cached")
            self.blocks.hold(b)

    def release(self, blocks: Iterable[int], stale: bool = False) -> None:
        """Drop one reference to each block; a cached one left unreferenced joins the
        LRU order, most recent last (first with `stale`: no one is expected to ask for it
        soon), an uncached one is free."""
        for b in reversed(list(blocks)):  # deepest first: ancestors end up more recent
            if not self.blocks.drop(b):
                continue
            entry = self._entry_of.get(b)
            window_of = self._window_entry_of.get(b)
            if entry is not None:
                entry.stamp = self._stamp(self._lru, entry.block, entry, stale)
            elif window_of is not None:
                if all(self.blocks.refs[w] == 0 for w in window_of.window_blocks):
                    window_of.window_stamp = self._stamp(self._window_lru, window_of.key,
                                                         window_of, stale)
            else:
                self.blocks.free([b])

    def _stamp(self, lru: OrderedDict[int, Entry], at: int, entry: Entry,
               stale: bool = False) -> int:
        """Put `entry` in `lru` under `at`: last, or first when `stale` or of a demoted
        version; its stamp."""
        lru[at] = entry
        if stale or entry.version in self._stale_versions:
            lru.move_to_end(at, last=False)
            return next(self._stale)
        return next(self._recent)

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def insert(self, tokens: Sequence[int], version: int, table: Sequence[int],
               num_tokens: int, finished: bool,
               window_tables: Sequence[Sequence[int]] = ()) -> None:
        """Index the blocks of `table` that hold `tokens[:num_tokens]`: every full block
        and, once their writer has `finished` (it drops its references next), the last
        part-filled one. A block whose prefix is cached already, in another block, stays
        unindexed; a writer that runs on indexes nothing after it, since an entry it holds
        under one it does not would make that one unevictable (`can_reserve` counts every
        unreferenced block as evictable). A table entry 0 is a block its writer dropped
        (outside every window, indexed first): indexing goes on below it while its entry
        is still cached, and stops where it was evicted. `window_tables`: the windowed
        groups' tables (a hybrid pool); a new entry keeps its block's window blocks
        unless the writer released them (0)."""
        if not self.indexing:
            return
        bs, parent = self.block_size, _ROOT
        end = num_tokens if finished else num_tokens - num_tokens % bs
        copying = False  # a running writer below a block it computed again: index nothing
        for i, start in enumerate(range(0, end, bs)):  # a partial block comes last
            block_tokens = tuple(tokens[start : min(start + bs, end)])
            key = _key(version, parent, block_tokens)
            cached = self._verified(version, parent, block_tokens)
            window = tuple(t[i] for t in window_tables)
            if table[i] == 0:  # dropped by its writer
                if cached is None:
                    return
            elif cached is None:
                if key in self._index or copying or table[i] in self._entry_of:
                    return  # a hash collision (or a block cached elsewhere: be safe)
                entry = Entry(key, parent, version, block_tokens, table[i])
                self._index[key] = self._entry_of[table[i]] = entry
                self._children.setdefault(parent, {})[key] = entry
                self.inserted_blocks += 1
                if self.blocks.refs[table[i]] == 0:  # (a sequence holds it: normally referenced)
                    entry.stamp = self._stamp(self._lru, table[i], entry)
                self._adopt_window_blocks(entry, window)
            elif cached.block != table[i]:  # computed again, by a hit cut short or a bypass
                self._adopt_window_blocks(cached, window)
                copying = copying or not finished
            parent = key

    def _adopt_window_blocks(self, entry: Entry, window: tuple[int, ...]) -> None:
        """Give an entry without window blocks these (the same positions' windowed KV,
        computed by a sequence that holds them), so later hits can end after it."""
        if entry.window_blocks or not window or not all(window) or any(
                b in self._window_entry_of or b in self._entry_of for b in window):
            return
        entry.window_blocks = window
        self._window_entry_of.update(dict.fromkeys(window, entry))
        if all(self.blocks.refs[b] == 0 for b in window):  # (normally its writer holds them)
            entry.window_stamp = self._stamp(self._window_lru, entry.key, entry)

    def evict(self, num_blocks: int, version: int | None = None) -> int:
        """Free at least `num_blocks` blocks if it can: unreferenced leaf entries (with
        their window blocks) and unreferenced window blocks, least recently used first
        (with `version`: while that unit is of that version); the count freed."""
        evicted = 0
        while evicted < num_blocks:
            leaf = next((e for e in self._lru.values() if e.key not in self._children), None)
            window = next(iter(self._window_lru.values()), None)
            if window is not None and (leaf is None or window.window_stamp < leaf.stamp):
                if version not in (None, window.version):
                    break
                evicted += self._drop_window_blocks(window)
                continue
            if leaf is None or version not in (None, leaf.version):
                break
            del self._lru[leaf.block], self._index[leaf.key], self._entry_of[leaf.block]
            siblings = self._children[leaf.parent_key]
            del siblings[leaf.key]
            if not siblings:
                del self._children[leaf.parent_key]
            self.blocks.free([leaf.block])
            evicted += 1
            if leaf.key in self._window_lru:
                evicted += self._drop_window_blocks(leaf)
            for b in leaf.window_blocks:  # held by a sequence (adopted): freed when released
                del self._window_entry_of[b]
        self.evicted_blocks += evicted
        return evicted

    def _drop_window_blocks(self, entry: Entry) -> int:
        """Free an entry's unreferenced window blocks; the count."""
        del self._window_lru[entry.key]
        for b in entry.window_blocks:
            del self._window_entry_of[b]
        self.blocks.free(entry.window_blocks)
        n, entry.window_blocks = len(entry.window_blocks), ()
        return n

    def demote_version(self, version: int) -> None:
        """`version`'s unreferenced entries go first when room is needed (in their LRU
        order), and so do those released later. They still serve hits."""
        self._stale_versions.add(version)
        for lru in (self._lru, self._window_lru):
            stale = [(at, e) for at, e in lru.items() if e.version == version]
            for at, e in reversed(stale):
                lru.move_to_end(at, last=False)
                if lru is self._lru:
                    e.stamp = next(self._stale)
                else:
                    e.window_stamp = next(self._stale)

    def drop_version(self, version: int) -> int:
        """Evict every unreferenced entry of `version` whose descendants go too;
        referenced ones stay, demoted. Returns the number evicted. (Demoted, they lead
        the LRU order, so its leaves are theirs until none is left.)"""
        self.demote_version(version)
        return self.evict(self.num_blocks, version)
