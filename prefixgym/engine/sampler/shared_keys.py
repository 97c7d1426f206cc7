"""Keys that several rows of a decode batch share, read once for all of them (a cascade).

A GRPO group's samples decode over one prompt, and a multi-turn rollout's episodes over
one system prompt and their group's first turn: the same KV blocks, handed out by the
prefix cache (or shared by a request's samples), sit at the head of many rows' block
tables. A decode step is memory-bound on reading keys and values (at 92M, 128 rows of
~320 positions: ~1 GB of fp32 a step), and one-query attention reads each row's keys
for that row alone. Here the rows' tables are split into segments: a run of blocks that
the same rows all hold (FlashInfer's cascade attention, generalised to a tree of
prefixes), whose keys are attended once for every query of those rows
(`shared_attention.SharedKeys`), and each row's own blocks after its deepest segment, which the
decode workspace holds (`DecodeWorkspace(offsets=...)`). The model merges the parts by
their log-sum-exp: the same softmax over the same keys, summed in another order (float
noise of fp32, like another batch size).

1) `SharedPlan.of(tables, starts, block_size)`: the segments, found by walking the rows'
   tables as a trie of block ids, and each row's first own position. Only blocks
   before the block a row writes next are shared (a shared block is a full one the
   cache or a fork hands out: never written again). A run shorter than `MIN_BLOCKS` is
   not a segment of its own: it is read with the segments below it (or the rows' own
   keys).
2) `SharedSegments(pool, plan, tables)`: each segment's keys and values gathered once
   from the pool (in the attend dtype), batched by their rows' count (a GRPO batch's
   groups are one count), so that a step makes a few attention calls, not one per
   segment; `layer(i)` is what a `DecodeView` hands the model for layer i.

Knows block tables and the pool's tensors; nothing of requests or the cache's index.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from prefixgym.engine.model import SharedKeys
from prefixgym.engine.sampler.kv_pool import KVPool, block_rows, gather_layers, table_tensor

__all__ = ["MIN_BLOCKS", "SharedPlan", "SharedSegments"]

MIN_BLOCKS = 2
"""Blocks a segment spans at least: a shorter run of shared blocks saves less than the
merge of one more part costs."""


@dataclass(frozen=True)
class SharedPlan:
    """`segments`: (rows, first block, end block) of each run of blocks those rows share,
    outer runs first; `offsets`: each row's first position of its own (the end of its
    deepest segment, in positions; 0 if it shares nothing)."""

    segments: list[tuple[list[int], int, int]]
    offsets: list[int]

    @staticmethod
    def none(num_rows: int) -> SharedPlan:
        return SharedPlan([], [0] * num_rows)

    @staticmethod
    def of(tables: list[list[int]], starts: list[int], block_size: int,
           min_blocks: int = MIN_BLOCKS) -> SharedPlan:
        """The segments of rows whose tables begin with the same block ids; row r may
        share its first `starts[r] // block_size` blocks (those before the one it writes)."""
        shareable = [min(s // block_size, len(t)) for t, s in zip(tables, starts)]
        segments: list[tuple[list[int], int, int]] = []
        offsets = [0] * len(tables)

        def walk(rows: list[int], depth: int, first: int) -> None:
            """`rows` share blocks [0, depth); the open run of them began at `first`."""
            by_block: dict[int, list[int]] = {}
            for r in rows:
                if depth < shareable[r]:
                    by_block.setdefault(tables[r][depth], []).append(r)
            for group in by_block.values():
                if len(group) < 2:
                    continue
                end = depth + 1
                while (all(end < shareable[r] for r in group)
                       and len({tables[r][end] for r in group}) == 1):
                    end += 1
                if end - first >= min_blocks:
                    segments.append((group, first, end))
                    for r in group:
                        offsets[r] = end * block_size
                    walk(group, end, end)
                else:  # too short alone: it goes with the segments below, if any
                    walk(group, end, first)

        walk(list(range(len(tables))), 0, 0)
        return SharedPlan(segments, offsets)

    def extent(self, starts: list[int]) -> int:
        """Positions of its own the longest row needs to hold `starts[r]`."""
        return max(s + 1 - o for s, o in zip(starts, self.offsets))


class SharedSegments:
    """A plan's segments' keys and values, gathered from `pool` once (they never change
    while rows hold them) in its attend dtype, batched by their rows' count: segments
    of one count are disjoint (a segment's rows are a strict subset of the one it
    continues), so a row has at most one segment in a batch."""

    def __init__(self, pool: KVPool, plan: SharedPlan, tables: list[list[int]]) -> None:
        dev, bs = pool.device, pool.block_size
        L, Hkv, D = len(pool.windows), pool.n_kv_heads, pool.k.shape[-1]
        by_count: dict[int, list[tuple[list[int], int, int]]] = {}
        for seg in plan.segments:
            by_count.setdefault(len(seg[0]), []).append(seg)
        self._batches: list[tuple[torch.Tensor, torch.Tensor, SharedKeys]] = []
        """Per batch: k and v (L, S, Hkv, Tk, D), and its `SharedKeys` but for them."""
        for _, segs in sorted(by_count.items()):
            S, nb = len(segs), max(end - first for _, first, end in segs)
            runs = [tables[rows[0]][first:end] for rows, first, end in segs]
            k = torch.empty(L, S, Hkv, nb * bs, D, dtype=pool.attend_dtype, device=dev)
            v = torch.empty_like(k)
            gather_layers(pool, [block_rows(pool, table_tensor(pool, runs, nb))], k, v)
            lengths = torch.tensor([(end - first) * bs for _, first, end in segs], device=dev)
            mask = None
            if int(lengths.min()) < nb * bs:  # padding keys of the shorter segments
                hidden = torch.arange(nb * bs, device=dev) >= lengths.unsqueeze(1)
                mask = torch.zeros(S, 1, 1, nb * bs, dtype=pool.attend_dtype,
                                   device=dev).masked_fill_(hidden[:, None, None], float("-inf"))
            rows_S_M = torch.tensor([rows for rows, _, _ in segs], device=dev)
            every_row = S == 1 and segs[0][0] == list(range(len(tables)))
            self._batches.append((k, v, SharedKeys(k[:0], v[:0], mask, rows_S_M, every_row)))

    def layer(self, layer_idx: int) -> list[SharedKeys]:
        """What layer `layer_idx` attends once per segment, batch by batch."""
        return [replace(part, k=k[layer_idx], v=v[layer_idx]) for k, v, part in self._batches]
