"""The block manager of the KV pool: which block ids are free, never used, or
referenced, and how often.

Ids run 1 .. num_blocks-1; 0 pads tables and is never handed out. A block is on the
free list (reused last-freed first), never used yet (ids from `next_fresh` on: its
pages were never touched, so whoever takes it zeroes it), or referenced by running
sequences (a count each). A block whose count falls to 0 is not freed here: whether it
holds a cached prefix (then it waits in the prefix cache's LRU order) or is free again
is prefix_cache.py's call, as are reservations and eviction.

Knows block ids and counts; nothing of tokens, prefixes or tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BlockManager"]


class BlockManager:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks  # per block id: the running sequences' references
        self.free_list: list[int] = []  # recycled blocks, reused last-freed first
        self.next_fresh = 1  # blocks >= this were never handed out

    def unused(self) -> int:
        """Blocks free or never used: what can be taken without evicting."""
        return len(self.free_list) + self.num_blocks - self.next_fresh

    def running(self) -> int:
        """Blocks some running sequence references."""
        return sum(1 for r in self.refs if r > 0)

    def take(self) -> tuple[int, bool]:
        """A free or never-used block (`unused()` > 0), referenced once: (block id,
        never used before -- zero it)."""
        if self.free_list:
            block, new = self.free_list.pop(), False
        else:
            block, new = self.next_fresh, True
            self.next_fresh += 1
        self.refs[block] = 1
        return block, new

    def hold(self, block: int) -> None:
        self.refs[block] += 1

    def drop(self, block: int) -> bool:
        """One reference fewer; whether that was the last."""
        if self.refs[block] <= 0:
            raise RuntimeError(f"release of block {block} that is not acquired")
        self.refs[block] -= 1
        return self.refs[block] == 0

    def free(self, blocks: Iterable[int]) -> None:
        """Unreferenced blocks that hold nothing to keep, onto the free list."""
        self.free_list.extend(blocks)
