"""A simulated prefix cache: which prompt tokens a block-granular LRU cache would serve.

Blocks hold `block_size` tokens and are keyed by the chain of all tokens up to
their end, so a block hits only when the whole prefix before it matches. Only full
blocks are cached; at most `capacity_tokens // block_size` blocks are kept, the
least recently used evicted first. At least one prompt token is always computed
(the model needs the logits of the last one). Knows nothing of tokenizers or models.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16
"""Tokens per simulated block unless a caller or `[tool.prefixgym.lint]` says otherwise."""
DEFAULT_CAPACITY_TOKENS = 1 << 20
"""Tokens the simulated cache holds before it evicts, by default."""


class SimulatedPrefixCache:
    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE,
                 capacity_tokens: int = DEFAULT_CAPACITY_TOKENS) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if capacity_tokens < block_size:
            raise ValueError(f"capacity_tokens ({capacity_tokens}) is below one block ({block_size})")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _keys(self, tokens: Sequence[int]) -> list[int]:
        keys, key = [], 0
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            key = hash((key, tuple(tokens[start : start + bs])))
            keys.append(key)
        return keys

    def match(self, tokens: Sequence[int]) -> int:
        """Cached prompt tokens for `tokens`; refreshes the matched blocks (reads only)."""
        hits = 0
        for key in self._keys(tokens):
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            hits += 1
        return min(hits * self.block_size, max(0, len(tokens) - 1))

    def insert(self, tokens: Sequence[int]) -> None:
        """Store every full block of `tokens`, evicting the least recently used beyond capacity."""
        for key in self._keys(tokens):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)
