"""The block manager of the KV pool, and the prefix cache that indexes the same blocks.

`PrefixCache` decides which of the pool's block ids (1 .. num_blocks-1; 0 pads tables)
are free, which a running sequence references (refcounts), and which hold a cached
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

Contract -- reads (no change to refcounts, LRU order, reservations or statistics):
`match`, `can_reserve`, `is_indexed`, `stats`, `check_integrity`, `len()`. Changes: `reserve` /
`unreserve` (blocks promised to admitted sequences, so decoding never runs out),
`allocate` (takes one reserved block, evicting if needed), `acquire` / `release`
(refcounts; an unindexed block whose last reference goes is free again), `insert`
(index a sequence's blocks), `record_lookup` (statistics), `demote_version` (a stale
version's unreferenced blocks are evicted first), `drop_version`, `evict`.

The cache knows nothing of tensors, models, requests or tokenizers: it maps token
prefixes to block ids and counts references.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

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


@dataclass
class Match:
    """The longest cached prefix of a token list: full `blocks` (root first), then the
    first `tail_tokens` positions of `tail_block` (to copy). `claim` names the first
    full block the caller will compute (None when there is none)."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    tail_block: int | None = None
    tail_tokens: int = 0
    claim: Hashable | None = None


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int, block_bytes: int,
                 indexing: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks, self.block_size, self.block_bytes = num_blocks, block_size, block_bytes
        self.indexing = indexing  # False: blocks are freed, never cached (prefix_cache=False)
        self._ref = [0] * num_blocks
        self._free: list[int] = []  # recycled blocks, reused last-freed first
        self._next_fresh = 1  # blocks >= this were never handed out
        self._index: dict[int, Entry] = {}
        self._entry_of: dict[int, Entry] = {}  # block id -> its entry
        self._children: dict[int, dict[int, Entry]] = {}  # parent key -> children (never empty)
        self._lru: OrderedDict[int, Entry] = OrderedDict()  # cached, unreferenced; LRU first
        self._stale_versions: set[int] = set()
        self.reserved = 0
        self.query_tokens = self.hit_tokens = 0
        self.inserted_blocks = self.evicted_blocks = 0

    # ---- reads -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def _available(self) -> int:
        return len(self._free) + self.num_blocks - self._next_fresh + len(self._lru)

    def can_reserve(self, num_blocks: int, pinning: Iterable[int] = ()) -> bool:
        """Whether `num_blocks` more blocks can be promised after referencing `pinning`."""
        evictable_pinned = sum(1 for b in set(pinning) if self._ref[b] == 0 and b in self._entry_of)
        return self._available() - evictable_pinned - self.reserved >= num_blocks

    def match(self, tokens: Sequence[int], version: int, max_tokens: int) -> Match:
        """The longest cached prefix of `tokens[:max_tokens]`. Reads only."""
        limit, bs = min(len(tokens), max_tokens), self.block_size
        found = Match()
        if not self.indexing:
            return found
        parent = _ROOT
        for start in range(0, limit - bs + 1, bs):
            entry = self._verified(version, parent, tuple(tokens[start : start + bs]))
            if entry is None:
                break
            found.blocks.append(entry.block)
            parent = entry.key
        n = found.num_tokens = len(found.blocks) * bs
        if n + bs <= len(tokens):
            found.claim = _key(version, parent, tuple(tokens[n : n + bs]))
        rest = tokens[n:limit]
        for child in self._children.get(parent, {}).values() if rest else ():
            if child.version != version:
                continue
            common = 0
            for a, b in zip(child.tokens, rest):
                if a != b:
                    break
                common += 1
            if common > found.tail_tokens:
                found.tail_block, found.tail_tokens = child.block, common
        found.num_tokens += found.tail_tokens
        return found

    def _verified(self, version: int, parent: int, tokens: tuple[int, ...]) -> Entry | None:
        entry = self._index.get(_key(version, parent, tokens))
        if entry is None or (entry.tokens, entry.version, entry.parent_key) != (
                tokens, version, parent):
            return None  # absent, or a hash collision
        return entry

    def is_indexed(self, block: int) -> bool:
        return block in self._entry_of

    def stats(self) -> dict[str, int]:
        return {
            "block_size": self.block_size,
            "capacity_bytes": self.num_blocks * self.block_bytes,
            "used_bytes": len(self._index) * self.block_bytes,
            "num_blocks": len(self._index),
            "referenced_blocks": len(self._index) - len(self._lru),
            "running_blocks": sum(1 for r in self._ref if r > 0),
            "free_blocks": len(self._free) + self.num_blocks - self._next_fresh,
            "reserved_blocks": self.reserved,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "inserted_blocks": self.inserted_blocks,
            "evicted_blocks": self.evicted_blocks,
        }

    def check_integrity(self, refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError naming the first broken invariant. `refs`: the number of
        running-sequence references to each block, as the caller counts them."""
        free = set(self._free)
        _require(len(free) == len(self._free), "a block is on the free list twice")
        _require(0 not in free and 0 not in self._entry_of and self._ref[0] == 0,
                 "the padding block 0 is in use")
        for b in range(1, self.num_blocks):
            used = self._ref[b] > 0 or b in self._entry_of
            never = b >= self._next_fresh
            _require(self._ref[b] >= 0, f"block {b} has ref_count {self._ref[b]}")
            _require(used + (b in free) + never == 1,
                     f"block {b}: used={used} free={b in free} never-used={never}")
            if refs is not None:
                _require(self._ref[b] == refs.get(b, 0),
                         f"block {b} counts {self._ref[b]} references, sequences hold "
                         f"{refs.get(b, 0)}")
        _require(0 <= self.reserved <= self._available(),
                 f"{self.reserved} blocks reserved, {self._available()} available")
        for key, e in self._index.items():
            _require(e.key == key == _key(e.version, e.parent_key, e.tokens),
                     f"entry {key} key does not match its (version, parent, tokens)")
            _require(self._entry_of.get(e.block) is e, f"entry {key} block map is stale")
            _require(0 < len(e.tokens) <= self.block_size, f"entry {key} has {len(e.tokens)} tokens")
            _require((self._ref[e.block] == 0) == (e.block in self._lru),
                     f"entry {key} ref {self._ref[e.block]} vs LRU membership")
            _require(self._children.get(e.parent_key, {}).get(key) is e,
                     f"entry {key} missing from its parent's children")
            if e.parent_key != _ROOT:
                parent = self._index.get(e.parent_key)
                _require(parent is not None, f"entry {key} has an evicted parent")
                assert parent is not None
                _require(len(parent.tokens) == self.block_size, f"entry {key} under a partial block")
                _require(parent.version == e.version, f"entry {key} version differs from its parent's")
                _require(self._ref[e.block] == 0 or self._ref[parent.block] > 0,
                         f"entry {key} is referenced, its parent is not (and cannot be evicted)")
        _require(len(self._entry_of) == len(self._index), "block map and index differ")
        _require(sum(len(c) for c in self._children.values()) == len(self._index),
                 "children lists and index differ")

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
        if not self._free and self._next_fresh == self.num_blocks and not self.evict(1):
            raise RuntimeError("no free block and no evictable one, though one was reserved")
        if self._free:
            block, new = self._free.pop(), False
        else:
            block, new = self._next_fresh, True
            self._next_fresh += 1
        self._ref[block] = 1
        return block, new

    def acquire(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._ref[b] == 0:
                if b not in self._lru:
                    raise RuntimeError(f"acquire of block {b}, which is neither used nor cached")
                del self._lru[b]
            self._ref[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for b in reversed(list(blocks)):  # deepest first: ancestors end up more recent
            if self._ref[b] <= 0:
                raise RuntimeError(f"release of block {b} that is not acquired")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                entry = self._entry_of.get(b)
                if entry is None:
                    self._free.append(b)
                else:
                    self._lru[b] = entry
                    if entry.version in self._stale_versions:
                        self._lru.move_to_end(b, last=False)

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def insert(self, tokens: Sequence[int], version: int, table: Sequence[int],
               num_tokens: int, finished: bool) -> None:
        """Index the blocks of `table` that hold `tokens[:num_tokens]`: every full block
        and, once their writer has `finished` (it drops its references next), the last
        part-filled one. A block whose prefix is cached already, in another block, stays
        unindexed; a writer that runs on indexes nothing after it, since an entry it holds
        under one it does not would make that one unevictable (`can_reserve` counts every
        unreferenced block as evictable). A table entry 0 is a block its writer dropped
        (outside every window, indexed first): indexing goes on below it while its entry
        is still cached, and stops where it was evicted."""
        if not self.indexing:
            return
        bs, parent = self.block_size, _ROOT
        end = num_tokens if finished else num_tokens - num_tokens % bs
        for i, start in enumerate(range(0, end, bs)):  # a partial block comes last
            block_tokens = tuple(tokens[start : min(start + bs, end)])
            key = _key(version, parent, block_tokens)
            if table[i] == 0:  # dropped by its writer
                if self._verified(version, parent, block_tokens) is None:
                    return
            elif key not in self._index:
                if table[i] in self._entry_of:
                    return  # the block is cached under another prefix (cannot happen; be safe)
                entry = Entry(key, parent, version, block_tokens, table[i])
                self._index[key] = self._entry_of[table[i]] = entry
                self._children.setdefault(parent, {})[key] = entry
                self.inserted_blocks += 1
                if self._ref[table[i]] == 0:  # (a sequence holds it: normally referenced)
                    self._lru[table[i]] = entry
            elif self._verified(version, parent, block_tokens) is None or (
                    not finished and self._index[key].block != table[i]):
                return  # a hash collision, or a copy of a cached block
            parent = key

    def evict(self, num_blocks: int, version: int | None = None) -> int:
        """Free up to `num_blocks` unreferenced leaf entries, least recently used first
        (with `version`: while the LRU leaf is of that version); the count."""
        evicted = 0
        while evicted < num_blocks:
            leaf = next((e for e in self._lru.values() if e.key not in self._children), None)
            if leaf is None or version not in (None, leaf.version):
                break
            del self._lru[leaf.block], self._index[leaf.key], self._entry_of[leaf.block]
            siblings = self._children[leaf.parent_key]
            del siblings[leaf.key]
            if not siblings:
                del self._children[leaf.parent_key]
            self._free.append(leaf.block)
            evicted += 1
        self.evicted_blocks += evicted
        return evicted

    def demote_version(self, version: int) -> None:
        """`version`'s unreferenced entries go first when room is needed (in their LRU
        order), and so do those released later. They still serve hits."""
        self._stale_versions.add(version)
        stale = [b for b, e in self._lru.items() if e.version == version]
        for b in reversed(stale):
            self._lru.move_to_end(b, last=False)

    def drop_version(self, version: int) -> int:
        """Evict every unreferenced entry of `version` whose descendants go too;
        referenced ones stay, demoted. Returns the number evicted. (Demoted, they lead
        the LRU order, so its leaves are theirs until none is left.)"""
        self.demote_version(version)
        return self.evict(len(self._lru), version)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"prefix cache integrity: {message}")
