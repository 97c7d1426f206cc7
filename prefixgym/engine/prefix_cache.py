"""The prefix KV cache: fixed-size blocks of KV keyed by a chained hash of their tokens.

A block holds the keys and values of `block_size` consecutive prompt positions, as one
tensor shaped (n_layers, 2, n_kv_heads, block_size, head_dim). Its key is
`hash((weights_version, parent_key, block_tokens))`, so a key names a whole prefix
under one set of weights. A hit is an exact token-level prefix match under the same
weights version: every hit is verified against the stored tokens, version and parent,
never trusted to the hash alone. Only full blocks are cached.

Contract -- which methods read and which change the cache:

- reads (no change to blocks, refcounts, LRU order or statistics):
  `match_prefix`, `can_insert`, `stats`, `check_integrity`, `block_bytes`, `len()`.
- changes: `acquire` / `release` (refcounts; a referenced block is never evicted),
  `insert` (adds blocks, evicting LRU unreferenced blocks to make room; check first
  with `can_insert`), `evict`, `record_lookup` (statistics only), `clear`,
  `demote_version` (a stale version's unreferenced blocks go first when room is
  needed, now and whenever they are released later), `drop_version` (evict every
  unreferenced block of a version that no client can ask for any more).

Eviction takes the least recently used unreferenced block that has no cached child,
so every cached block's parent is cached too. Callers acquire whole chains from the
root (a `Match`), so a referenced block's parent is referenced at least as often.

The cache knows nothing of models, requests, slots or tokenizers: it stores tensors
it is given and hands them back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

_ROOT_KEY = 0
ROOT_KEY = _ROOT_KEY  # the parent key of a chain's first block


@dataclass(eq=False)
class Block:
    """One cached block. `kv` is (n_layers, 2, n_kv_heads, block_size, head_dim)."""

    key: int
    parent_key: int
    version: int
    tokens: tuple[int, ...]
    kv: torch.Tensor
    depth: int
    ref_count: int = 0
    num_children: int = 0


@dataclass
class Match:
    """The longest cached block-aligned prefix of a token list, root block first."""

    blocks: list[Block] = field(default_factory=list)
    block_size: int = 16

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


def chain_key(version: int, parent_key: int, tokens: tuple[int, ...]) -> int:
    return hash((version, parent_key, tokens))


class PrefixCache:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        capacity_bytes: int = 256 * 2**20,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.block_shape = (n_layers, 2, n_kv_heads, block_size, head_dim)
        self.block_size = block_size
        self.capacity_bytes = capacity_bytes
        self.dtype = dtype
        element_bytes = torch.empty((), dtype=dtype).element_size()
        self._block_bytes = n_layers * 2 * n_kv_heads * block_size * head_dim * element_bytes
        self._blocks: dict[int, Block] = {}
        # unreferenced blocks, least recently used first
        self._lru: OrderedDict[int, Block] = OrderedDict()
        self.used_bytes = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0
        self.inserted_blocks = 0
        self._stale_versions: set[int] = set()

    # ---- reads -------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def match_prefix(
        self, tokens: Sequence[int], version: int, max_tokens: int | None = None
    ) -> Match:
        """The longest cached prefix of `tokens[:max_tokens]` in whole blocks. Reads only."""
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        bs = self.block_size
        blocks: list[Block] = []
        parent = _ROOT_KEY
        for start in range(0, limit - bs + 1, bs):
            block_tokens = tuple(tokens[start : start + bs])
            block = self._blocks.get(chain_key(version, parent, block_tokens))
            if (
                block is None
                or block.tokens != block_tokens
                or block.version != version
                or block.parent_key != parent
            ):
                break
            blocks.append(block)
            parent = block.key
        return Match(blocks=blocks, block_size=bs)

    def can_insert(self, num_blocks: int) -> bool:
        """Whether `num_blocks` new blocks fit, evicting unreferenced blocks if needed."""
        evictable = len(self._lru) * self._block_bytes
        return self.used_bytes + num_blocks * self._block_bytes - evictable <= self.capacity_bytes

    def stats(self) -> dict[str, int]:
        return {
            "block_size": self.block_size,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "num_blocks": len(self._blocks),
            "referenced_blocks": len(self._blocks) - len(self._lru),
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "inserted_blocks": self.inserted_blocks,
            "evicted_blocks": self.evicted_blocks,
        }

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        n = len(self._blocks)
        _require(
            self.used_bytes == n * self._block_bytes,
            f"used_bytes {self.used_bytes} != {n} blocks x {self._block_bytes} bytes",
        )
        _require(
            self.used_bytes <= self.capacity_bytes,
            f"used_bytes {self.used_bytes} exceeds capacity_bytes {self.capacity_bytes}",
        )
        children: dict[int, int] = {}
        for key, block in self._blocks.items():
            _require(block.key == key, f"block stored under key {key} has key {block.key}")
            _require(block.ref_count >= 0, f"block {key} has ref_count {block.ref_count}")
            _require(len(block.tokens) == self.block_size, f"block {key} is not full")
            _require(
                tuple(block.kv.shape) == self.block_shape,
                f"block {key} kv shape {tuple(block.kv.shape)} != {self.block_shape}",
            )
            _require(
                key == chain_key(block.version, block.parent_key, block.tokens),
                f"block {key} key does not match its (version, parent, tokens)",
            )
            _require(
                (block.ref_count == 0) == (key in self._lru),
                f"block {key} with ref_count {block.ref_count} "
                f"{'is' if key in self._lru else 'is not'} in the LRU list",
            )
            if block.parent_key != _ROOT_KEY:
                parent = self._blocks.get(block.parent_key)
                _require(parent is not None, f"block {key} has an evicted parent")
                assert parent is not None
                _require(parent.version == block.version, f"block {key} parent has other version")
                _require(parent.depth + 1 == block.depth, f"block {key} depth is inconsistent")
                _require(
                    parent.ref_count >= block.ref_count,
                    f"block {key} referenced {block.ref_count}x but its parent "
                    f"{parent.ref_count}x",
                )
                children[parent.key] = children.get(parent.key, 0) + 1
            else:
                _require(block.depth == 0, f"root block {key} has depth {block.depth}")
        for key, block in self._blocks.items():
            _require(
                block.num_children == children.get(key, 0),
                f"block {key} counts {block.num_children} children, has {children.get(key, 0)}",
            )
        _require(all(k in self._blocks for k in self._lru), "LRU list holds an evicted block")

    # ---- changes -----------------------------------------------------------------

    def acquire(self, blocks: Sequence[Block]) -> None:
        """Reference a root-first chain of blocks: they cannot be evicted until released."""
        for block in blocks:
            if block.ref_count == 0:
                self._lru.pop(block.key, None)
            block.ref_count += 1

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference on each block of a chain given to `acquire`."""
        for block in reversed(blocks):  # deepest first, so ancestors end up more recent
            if block.ref_count <= 0:
                raise RuntimeError(f"release of block {block.key} that is not acquired")
            block.ref_count -= 1
            if block.ref_count == 0 and self._blocks.get(block.key) is block:
                self._lru[block.key] = block
                if block.version in self._stale_versions:
                    self._lru.move_to_end(block.key, last=False)

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def insert(
        self,
        tokens: Sequence[int],
        version: int,
        kv_of_block: Callable[[int], torch.Tensor],
        max_tokens: int | None = None,
    ) -> list[Block]:
        """Cache the full blocks of `tokens[:max_tokens]` that are not cached yet.

        `kv_of_block(i)` returns the KV of block i, shaped like `block_shape`; it is
        copied. Blocks already cached are refreshed in the LRU order. Makes room by
        evicting unreferenced blocks; stops early when everything left is referenced.
        Returns the cached chain, root first (possibly shorter than asked).
        """
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        bs = self.block_size
        chain: list[Block] = []
        parent_key = _ROOT_KEY
        try:
            for index, start in enumerate(range(0, limit - bs + 1, bs)):
                block_tokens = tuple(tokens[start : start + bs])
                key = chain_key(version, parent_key, block_tokens)
                block = self._blocks.get(key)
                if block is not None:
                    if (
                        block.tokens != block_tokens
                        or block.version != version
                        or block.parent_key != parent_key
                    ):
                        break  # a hash collision: this prefix stays uncached
                else:
                    if self.used_bytes + self._block_bytes > self.capacity_bytes:
                        self.evict(self.used_bytes + self._block_bytes - self.capacity_bytes)
                        if self.used_bytes + self._block_bytes > self.capacity_bytes:
                            break
                    kv = kv_of_block(index)
                    if tuple(kv.shape) != self.block_shape:
                        raise ValueError(f"block kv shape {tuple(kv.shape)} != {self.block_shape}")
                    block = Block(
                        key=key,
                        parent_key=parent_key,
                        version=version,
                        tokens=block_tokens,
                        kv=kv.to(self.dtype).clone(),
                        depth=index,
                    )
                    self._blocks[key] = block
                    self.used_bytes += self._block_bytes
                    self.inserted_blocks += 1
                    if parent_key != _ROOT_KEY:
                        self._blocks[parent_key].num_children += 1
                self.acquire([block])  # pinned so making room never evicts our own chain
                chain.append(block)
                parent_key = key
        finally:
            self.release(chain)
        return chain

    def evict(self, num_bytes: int) -> int:
        """Evict LRU unreferenced leaf blocks until `num_bytes` are freed. Returns blocks evicted."""
        freed = 0
        evicted = 0
        while freed < num_bytes:
            victim = next((b for b in self._lru.values() if b.num_children == 0), None)
            if victim is None:
                break
            self._remove(victim)
            freed += self._block_bytes
            evicted += 1
        return evicted

    def demote_version(self, version: int) -> None:
        """Make `version`'s unreferenced blocks the first to be evicted (keeping their
        relative LRU order), and those released later too. They still serve hits."""
        self._stale_versions.add(version)
        stale = [key for key, block in self._lru.items() if block.version == version]
        for key in reversed(stale):
            self._lru.move_to_end(key, last=False)

    def drop_version(self, version: int) -> int:
        """Evict every unreferenced block of `version` whose descendants go too (deepest
        first); referenced blocks stay, demoted. Returns the number evicted."""
        self.demote_version(version)
        stale = sorted((b for b in self._lru.values() if b.version == version),
                       key=lambda b: -b.depth)
        removed = 0
        for block in stale:
            if block.num_children == 0:
                self._remove(block)
                removed += 1
        return removed

    def clear(self) -> None:
        """Drop every unreferenced block."""
        self.evict(self.used_bytes)

    def _remove(self, block: Block) -> None:
        del self._lru[block.key]
        del self._blocks[block.key]
        self.used_bytes -= self._block_bytes
        self.evicted_blocks += 1
        if block.parent_key != _ROOT_KEY:
            self._blocks[block.parent_key].num_children -= 1


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"prefix cache integrity: {message}")
