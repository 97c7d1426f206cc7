"""The token trie of one training call: which rows compute which datums' positions.

Causal attention makes a position's hidden state depend only on the tokens up to it,
so datums whose inputs start with the same tokens have the same states there, and a
training call needs each distinct prefix position computed once. This module plans
that computation; `shared_forward.py` runs the plan.

1) Sort the datums' token lists, a list sorting *after* every list it is a prefix of
   (so the longer one is computed and the shorter reuses its rows). In that order,
   no earlier datum shares more with datum i than datum i-1 does: datum i's first
   `lcp_i` positions (the longest common prefix with datum i-1) are rows already
   computed for datum i-1, and positions [lcp_i, n_i) are new, datum i's *segment*.
2) Pack consecutive sorted datums into chunks whose estimated memory fits the token
   budget. A chunk's first datum shares nothing, so a trie too big for one chunk is
   cut between sorted neighbours and the cut-off part computes its prefix again.
3) Give each segment of a chunk a level: 0 without context, else one more than the
   segment its context ends in. Group the segments of a level, by length, into waves
   (one forward each, right-padded); waves run in level order, so a segment's context
   rows (the keys/values of earlier waves) exist when it reads them.
4) Map every (datum, position) of the chunk to the row computing it.

This module knows token ids, lengths and a memory estimate in positions; not models,
losses or devices (it builds CPU tensors).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["TriePlan", "Wave", "plan_chunks", "shard_by_prefix", "sorted_with_lcp"]

Tensor = torch.Tensor

PAD_SLACK = 32
"""Padded positions a wave may waste before its segments are split into two waves
(or a quarter of the wave, if more): a forward's fixed cost is worth tens of positions."""


@dataclass
class Wave:
    """One forward: `n` segments of one level, right-padded to `L` positions."""

    tokens_N_L: Tensor  # int64, padded with 0
    positions_N_L: Tensor  # int64, the positions in their datums; padding 0
    context_N_A: Tensor | None  # rows of the key/value store each segment attends to first
    mask_N_1_L_K: Tensor | None  # bool, K = A + L; None: plain causal (no context)
    store_offset: int  # this wave's first row in the key/value store, if `stored`
    stored: bool  # whether a later wave reads its keys/values
    rows_used: Tensor  # flat rows (b * L + t) of this wave read by the chunk's datums ...
    cells_used: Tensor  # ... into these cells of the chunk's flattened (B, T) grid

    @property
    def padded_positions(self) -> int:
        return int(self.tokens_N_L.numel())

    @property
    def padded_context(self) -> int:
        return 0 if self.context_N_A is None else int(self.context_N_A.numel())


@dataclass
class TriePlan:
    """One chunk: its datums in sorted order, its waves, and where each cell's row is."""

    indices: list[int]  # into the call's datums, in the order of the chunk's (B, T) rows
    waves: list[Wave]
    order_B_T: Tensor  # cell -> index into the waves' picked values, in wave order; padding -> last
    computed_tokens: int  # distinct positions: the segments' lengths summed

    def cost(self, context_weight: float) -> float:
        return sum(w.padded_positions + context_weight * w.padded_context for w in self.waves)


@dataclass
class _Segment:
    slot: int  # the datum's row b in the chunk
    start: int  # first position it computes (= its context length)
    end: int
    level: int
    context: list[tuple[int, int, int]]  # (segment, from, to) covering positions [0, start)
    wave: int = -1
    index_in_wave: int = -1
    referenced: bool = False

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class _Chunk:
    indices: list[int] = field(default_factory=list)
    shares: list[int] = field(default_factory=list)  # lcp with the chunk's previous datum
    cost: float = 0.0


def _lcp(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def sorted_with_lcp(tokens: Sequence[list[int]]) -> tuple[list[int], list[int]]:
    """Indices in trie order (step 1) and each one's lcp with its predecessor (0 first)."""
    end = 1 + max((max(t) for t in tokens if t), default=0)  # sorts after every token
    order = sorted(range(len(tokens)), key=lambda i: (*tokens[i], end))
    lcps = [0] + [_lcp(tokens[a], tokens[b]) for a, b in itertools.pairwise(order)]
    return order, lcps


def shard_by_prefix(tokens: Sequence[list[int]], world_size: int) -> list[list[int]]:
    """Split datums into `world_size` runs of trie order with about equal new positions,
    so that datums sharing prefixes land on one rank (data-parallel training)."""
    order, lcps = sorted_with_lcp(tokens)
    costs = [len(tokens[i]) - s for i, s in zip(order, lcps)]
    total = sum(costs)
    shards: list[list[int]] = [[] for _ in range(world_size)]
    done = 0
    for i, c in zip(order, costs):
        rank = min(world_size - 1, (done * world_size) // max(total, 1))
        shards[rank].append(i)
        done += c
    return shards


def plan_chunks(
    tokens: Sequence[list[int]], budget: int, context_weight: float
) -> list[TriePlan]:
    """Plans whose cost (padded positions + context_weight x padded context rows) stays
    within `budget`, except a single datum longer than it (steps 1-4)."""
    order, lcps = sorted_with_lcp(tokens)
    lengths = [len(t) for t in tokens]
    # 2) greedy packing on the unpadded cost; a plan that pads past the budget is halved
    chunks: list[_Chunk] = []
    for i, share in zip(order, lcps):
        new, context = lengths[i] - share, share * context_weight
        if chunks and chunks[-1].cost + new + context <= budget:
            chunks[-1].indices.append(i)
            chunks[-1].shares.append(share)
            chunks[-1].cost += new + context
        else:
            chunks.append(_Chunk([i], [0], float(lengths[i])))
    plans: list[TriePlan] = []
    pending = [(c.indices, c.shares) for c in chunks]
    while pending:
        indices, shares = pending.pop(0)
        plan = _plan_chunk(indices, shares, [lengths[i] for i in indices], tokens)
        if len(indices) > 1 and plan.cost(context_weight) > budget:
            half = len(indices) // 2
            pending[:0] = [(indices[:half], shares[:half]),
                           (indices[half:], [0] + shares[half + 1:])]
            continue
        plans.append(plan)
    return plans


def _plan_chunk(
    indices: list[int], shares: list[int], lengths: list[int], tokens: Sequence[list[int]]
) -> TriePlan:
    # 3) segments and levels; `stack` covers the previous datum: (segment, first position)
    segments: list[_Segment] = []
    coverage: list[list[tuple[int, int, int]]] = []  # per slot: (segment, from, to)
    stack: list[tuple[int, int]] = []
    for slot, (share, n) in enumerate(zip(shares, lengths)):
        while stack and stack[-1][1] >= share:
            stack.pop()
        bounds = [*(s for _, s in stack[1:]), share]
        context = [(seg, lo, hi) for (seg, lo), hi in zip(stack, bounds)]
        for seg, _, _ in context:
            segments[seg].referenced = True
        if n > share:
            level = segments[stack[-1][0]].level + 1 if stack else 0
            segments.append(_Segment(slot, share, n, level, context))
            stack.append((len(segments) - 1, share))
            coverage.append([*context, (len(segments) - 1, share, n)])
        else:  # equal to, or a prefix of, the previous datum: nothing new
            coverage.append([(seg, lo, min(hi, n)) for seg, lo, hi in context if lo < n])
    waves = _group_into_waves(segments)
    return _build_tensors(segments, waves, coverage, lengths, indices, tokens)


def _group_into_waves(segments: list[_Segment]) -> list[list[int]]:
    """Segments by level; within a level, longest first, a new wave when padding to the
    wave's longest segment would waste more than PAD_SLACK positions or a quarter."""
    by_level: dict[int, list[int]] = {}
    for s, seg in enumerate(segments):
        by_level.setdefault(seg.level, []).append(s)
    waves: list[list[int]] = []
    for level in sorted(by_level):
        members = sorted(by_level[level], key=lambda s: -segments[s].length)
        current: list[int] = []
        total = 0
        for s in members:
            length = segments[s].length
            if current:
                padded = (len(current) + 1) * segments[current[0]].length
                if padded - (total + length) <= max(PAD_SLACK, padded // 4):
                    current.append(s)
                    total += length
                    continue
                waves.append(current)
            current, total = [s], length
        waves.append(current)
    for w, members in enumerate(waves):
        for k, s in enumerate(members):
            segments[s].wave, segments[s].index_in_wave = w, k
    return waves


def _build_tensors(
    segments: list[_Segment], waves: list[list[int]], coverage: list[list[tuple[int, int, int]]],
    lengths: list[int], indices: list[int], tokens: Sequence[list[int]],
) -> TriePlan:
    # 4) rows: wave w's row of (segment, position p) is index_in_wave * L_w + p - start
    widths = [max(segments[s].length for s in members) for members in waves]
    stored = [any(segments[s].referenced for s in members) for members in waves]
    store_offsets, at = [], 0
    for members, width, keep in zip(waves, widths, stored):
        store_offsets.append(at)
        at += len(members) * width if keep else 0

    def rows(seg_index: int, lo: int, hi: int, store: bool) -> Tensor:
        seg = segments[seg_index]
        base = seg.index_in_wave * widths[seg.wave] + lo - seg.start
        if store:
            base += store_offsets[seg.wave]
        return torch.arange(base, base + hi - lo)

    built: list[Wave] = []
    cells: list[list[Tensor]] = [[] for _ in waves]
    wave_rows: list[list[Tensor]] = [[] for _ in waves]
    T = max(lengths)
    for slot, pieces in enumerate(coverage):
        for seg_index, lo, hi in pieces:
            w = segments[seg_index].wave
            cells[w].append(torch.arange(slot * T + lo, slot * T + hi))
            wave_rows[w].append(rows(seg_index, lo, hi, store=False))
    for w, (members, L) in enumerate(zip(waves, widths)):
        n = len(members)
        tokens_N_L = torch.zeros(n, L, dtype=torch.long)
        positions_N_L = torch.zeros(n, L, dtype=torch.long)
        A = max(segments[s].start for s in members)
        context_N_A = torch.zeros(n, A, dtype=torch.long) if A else None
        mask = torch.zeros(n, 1, L, A + L, dtype=torch.bool) if A else None
        for k, s in enumerate(members):
            seg = segments[s]
            ids = tokens[indices[seg.slot]][seg.start:seg.end]
            tokens_N_L[k, : seg.length] = torch.tensor(ids, dtype=torch.long)
            positions_N_L[k, : seg.length] = torch.arange(seg.start, seg.end)
            if context_N_A is not None and mask is not None:
                if seg.start:
                    context_N_A[k, : seg.start] = torch.cat(
                        [rows(c, lo, hi, store=True) for c, lo, hi in seg.context])
                mask[k, 0, :, : seg.start] = True
        if mask is not None:
            mask[:, 0, :, A:] = torch.ones(L, L, dtype=torch.bool).tril()
        built.append(Wave(
            tokens_N_L, positions_N_L, context_N_A, mask, store_offsets[w], stored[w],
            rows_used=torch.cat(wave_rows[w]) if wave_rows[w] else torch.zeros(0, dtype=torch.long),
            cells_used=torch.cat(cells[w]) if cells[w] else torch.zeros(0, dtype=torch.long),
        ))
    # cell -> position in the concatenation of the waves' picked values; padding -> the end
    used = sum(int(w.cells_used.numel()) for w in built)
    order_B_T = torch.full((len(indices) * T,), used, dtype=torch.long)
    order_B_T[torch.cat([w.cells_used for w in built])] = torch.arange(used)
    return TriePlan(indices, built, order_B_T.view(len(indices), T),
                    sum(seg.length for seg in segments))
