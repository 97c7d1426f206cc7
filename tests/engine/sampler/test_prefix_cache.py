"""The block manager and prefix index: prefix matches down to the token, refcounts,
reservations, LRU leaf-first eviction, versions."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from prefixgym.engine.sampler import prefix_cache as pc
from prefixgym.engine.sampler.cache_integrity import check_prefix_cache
from prefixgym.engine.sampler.prefix_cache import PrefixCache

BS = 4


def run_sequence(cache: PrefixCache, tokens: list[int], version: int = 0,
                 partial: bool = True, keep: bool = False) -> list[int]:
    """What the scheduler does for one sequence that computes all of `tokens`: promise
    and take its blocks, index them when finished, drop its references (unless `keep`)."""
    need = -(-len(tokens) // BS)
    cache.reserve(need)
    table = [cache.allocate()[0] for _ in range(need)]
    cache.insert(tokens, version, table, len(tokens), finished=partial)
    if not keep:
        cache.release(table)
    return table


def test_match_full_blocks_then_down_to_the_token() -> None:
    cache = PrefixCache(num_blocks=32, block_size=BS, block_bytes=1)
    tokens = list(range(11))  # two full blocks and a partial one of 3
    table = run_sequence(cache, tokens)
    assert len(cache) == 3
    m = cache.match(tokens + [99], 0, max_tokens=11)
    assert (m.blocks, m.num_tokens, m.tail_block, m.tail_tokens) == (table[:2], 11, table[2], 3)
    m = cache.match(tokens[:10] + [77, 78], 0, max_tokens=12)  # diverges inside the partial
    assert (m.num_tokens, m.tail_tokens) == (10, 2)
    m = cache.match(tokens[:6] + [50, 51, 52], 0, max_tokens=9)  # inside a full block
    assert (m.blocks, m.num_tokens, m.tail_block) == (table[:1], 6, table[1])
    assert cache.match(tokens, 0, max_tokens=7).num_tokens == 7
    assert cache.match([5] + tokens[1:], 0, max_tokens=11).num_tokens == 0
    check_prefix_cache(cache)


def test_other_weights_version_never_hits() -> None:
    cache = PrefixCache(num_blocks=32, block_size=BS, block_bytes=1)
    tokens = list(range(10))
    run_sequence(cache, tokens, version=0)
    assert cache.match(tokens, 1, 10).num_tokens == 0
    table = run_sequence(cache, tokens, version=1)
    m = cache.match(tokens, 1, 10)
    assert m.blocks == table[:2] and m.tail_block == table[2]


def test_hash_collision_is_verified_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "_key", lambda version, parent, tokens: 1)
    cache = PrefixCache(num_blocks=32, block_size=BS, block_bytes=1)
    run_sequence(cache, [1, 2, 3, 4])
    assert cache.match([5, 6, 7, 8, 9], 0, 5).num_tokens == 0
    run_sequence(cache, [5, 6, 7, 8])  # cannot be indexed under the taken key
    assert len(cache) == 1 and cache.match([1, 2, 3, 4, 0], 0, 5).num_tokens == 4
    check_prefix_cache(cache)


def test_reservations_refcounts_and_lru_leaf_first_eviction() -> None:
    cache = PrefixCache(num_blocks=5, block_size=BS, block_bytes=1)  # 4 usable
    a = list(range(8))  # a0 <- a1
    held = run_sequence(cache, a, keep=True)
    assert cache.can_reserve(2) and not cache.can_reserve(3)
    b = [50, 51, 52, 53]
    run_sequence(cache, b)
    c = [70, 71, 72, 73]
    run_sequence(cache, c)  # the pool is full: b, c cached and unreferenced
    assert not cache.can_reserve(3)  # a is referenced
    assert cache.can_reserve(2) and not cache.can_reserve(2, pinning=cache.match(b, 0, 4).blocks)
    cache.release(held)  # a1 then a0 join the LRU list after b and c
    for touched in (b, c):  # use b and c again: a is now the least recently used
        m = cache.match(touched, 0, 4)
        cache.acquire(m.blocks)
        cache.release(m.blocks)
    run_sequence(cache, [90, 91, 92, 93])  # evicts the LRU leaf a1, not its parent a0
    assert cache.match(a, 0, 8).num_tokens == 4
    run_sequence(cache, [95, 96, 97, 98])  # then a0 (now a leaf), before b
    assert cache.match(a, 0, 8).num_tokens == 0 and cache.match(b, 0, 4).num_tokens == 4
    assert cache.stats()["evicted_blocks"] == 2
    check_prefix_cache(cache)


def test_refused_misuse() -> None:
    cache = PrefixCache(num_blocks=3, block_size=BS, block_bytes=1)
    table = run_sequence(cache, [1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="not acquired"):
        cache.release(table)
    with pytest.raises(RuntimeError, match="reserve"):
        cache.reserve(3)
    with pytest.raises(RuntimeError, match="unreserve"):
        cache.allocate()
    with pytest.raises(ValueError, match="at least 2"):
        PrefixCache(num_blocks=1, block_size=BS, block_bytes=1)
    check_prefix_cache(cache)


def test_check_integrity_reports_broken_accounting() -> None:
    cache = PrefixCache(num_blocks=8, block_size=BS, block_bytes=1)
    table = run_sequence(cache, [1, 2, 3, 4], keep=True)
    with pytest.raises(AssertionError, match="sequences hold 0"):
        check_prefix_cache(cache, refs={})
    check_prefix_cache(cache, refs={table[0]: 1})
    cache.reserved = 100
    with pytest.raises(AssertionError, match="reserved"):
        check_prefix_cache(cache)


def test_versions_demoted_first_and_dropped() -> None:
    cache = PrefixCache(num_blocks=5, block_size=BS, block_bytes=1)
    old, new = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14]
    run_sequence(cache, old, version=0)
    run_sequence(cache, new, version=1)
    cache.demote_version(0)
    for i in (2, 3, 4):  # the first fills the pool, the others evict version 0's blocks
        run_sequence(cache, [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4], version=1)
    assert cache.match(old, 0, 8).num_tokens == 0 and cache.match(new, 1, 4).num_tokens == 4
    held = run_sequence(cache, [41, 42, 43], version=2, keep=True)
    assert cache.drop_version(2) == 0 and len(cache) == 4  # referenced: stays
    cache.release(held)
    assert cache.drop_version(2) == 1
    check_prefix_cache(cache)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


op = st.one_of(
    st.tuples(st.just("run"), st.lists(st.integers(0, 2), min_size=1, max_size=14),
              st.integers(0, 1), st.booleans()),
    st.tuples(st.just("match"), st.lists(st.integers(0, 2), max_size=14), st.integers(0, 1),
              st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 10), st.just(0), st.booleans()),
    st.tuples(st.just("evict"), st.integers(1, 3), st.just(0), st.booleans()),
)


@given(st.lists(op, max_size=40), st.integers(6, 12))
def test_random_operations_keep_invariants_and_match_the_longest_cached_prefix(
    ops: list[tuple], num_blocks: int
) -> None:
    cache = PrefixCache(num_blocks=num_blocks, block_size=BS, block_bytes=1)
    held: list[list[int]] = []
    refs: dict[int, int] = {}
    for name, arg, version, flag in ops:
        if name == "run" and cache.can_reserve(-(-len(arg) // BS)):
            table = run_sequence(cache, arg, version, partial=not flag, keep=flag)
            if flag:
                held.append(table)
                for b in table:
                    refs[b] = refs.get(b, 0) + 1
        elif name == "match":
            m = cache.match(arg, version, len(arg))
            stored = [_entry_prefix(cache, e) for e in cache._index.values() if e.version == version]
            assert m.num_tokens == max((_lcp(arg, s) for s in stored), default=0)
            assert len(m.blocks) == m.num_tokens // BS
        elif name == "release" and held:
            for b in held.pop(arg % len(held)):
                cache.release([b])
                refs[b] -= 1
        elif name == "evict":
            cache.evict(arg)
        check_prefix_cache(cache, refs={b: n for b, n in refs.items() if n})


def _entry_prefix(cache: PrefixCache, entry: pc.Entry) -> list[int]:
    tokens = list(entry.tokens)
    while entry.parent_key != 0:
        entry = cache._index[entry.parent_key]
        tokens = list(entry.tokens) + tokens
    return tokens


@dataclass
class _Seq:
    """A sequence as the scheduler runs one: admitted (cached blocks held, the rest
    promised), prefilled (its prompt's full blocks indexed while it runs on), finished."""

    prompt: list[int]
    version: int
    decoded: list[int]
    table: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)  # a cached block it copies from
    reserved: int = 0


_prompts = st.tuples(st.integers(0, 12), st.lists(st.integers(0, 1), max_size=4)).map(
    lambda cut_rest: list(range(20, 20 + cut_rest[0])) + cut_rest[1]).filter(bool)
lifecycle_op = st.one_of(  # admit (reading the cache or not), prefill, finish, evict
    st.tuples(st.just("admit"), _prompts,
              st.lists(st.integers(0, 1), max_size=6), st.integers(0, 1), st.booleans()),
    st.tuples(st.sampled_from(["prefill", "finish", "evict"]), st.integers(0, 9),
              st.just([]), st.just(0), st.just(False)),
)


_A, _B = list(range(20, 28)), [20, 21, 22, 23, 0, 0, 0, 0]  # one block in common


@given(st.lists(lifecycle_op, max_size=40), st.integers(4, 10))
@example([("admit", _A, [], 0, True), ("prefill", 0, [], 0, False), ("finish", 0, [], 0, False),
          ("admit", _B, [], 0, False), ("prefill", 0, [], 0, False)], 6)  # B bypasses the cache
@example([("admit", _A, [], 0, True), ("admit", _B, [], 0, True), ("prefill", 0, [], 0, False),
          ("prefill", 0, [], 0, False), ("finish", 0, [], 0, False)], 6)  # admitted together
def test_promised_blocks_can_always_be_allocated(ops: list[tuple], num_blocks: int) -> None:
    """A small pool under the scheduler's protocol: sequences that bypass the cache, or
    were admitted together with one computing the same prefix, compute blocks it holds
    already. Whatever `can_reserve` says fits, on top of what is promised, is allocated."""
    cache = PrefixCache(num_blocks=num_blocks, block_size=BS, block_bytes=1)
    admitted: list[_Seq] = []
    running: list[_Seq] = []
    for name, arg, decoded, version, reads in ops:
        if name == "admit":
            seq = _Seq(arg, version, decoded)
            m = cache.match(arg, version, len(arg) - 1) if reads else pc.Match()
            tail = [m.tail_block] if m.tail_block is not None else []
            need = -(-(len(arg) + len(decoded)) // BS) - len(m.blocks)
            if cache.can_reserve(need, pinning=m.blocks + tail):
                cache.acquire(m.blocks + tail)
                cache.reserve(need)
                seq.table, seq.tail, seq.reserved = list(m.blocks), tail, need
                admitted.append(seq)
        elif name == "prefill" and admitted:
            seq = admitted.pop(arg % len(admitted))
            _take(cache, seq, -(-len(seq.prompt) // BS))
            cache.insert(seq.prompt, seq.version, seq.table, len(seq.prompt), finished=False)
            cache.release(seq.tail)
            seq.tail = []
            running.append(seq)
        elif name == "finish" and running:
            seq = running.pop(arg % len(running))
            tokens = seq.prompt + seq.decoded
            _take(cache, seq, -(-len(tokens) // BS))
            cache.insert(tokens, seq.version, seq.table, len(tokens), finished=True)
            cache.release(seq.table)
            cache.unreserve(seq.reserved)
        elif name == "evict":
            cache.evict(arg)
        refs: dict[int, int] = {}
        for s in admitted + running:
            for b in s.table + s.tail:
                refs[b] = refs.get(b, 0) + 1
        check_prefix_cache(cache, refs)
        assert cache.reserved == sum(s.reserved for s in admitted + running)
        more = max(n for n in range(num_blocks) if cache.can_reserve(n))
        trial = copy.deepcopy(cache)
        trial.reserve(more)
        for _ in range(trial.reserved):  # every promise kept, and `more` besides
            trial.allocate()


def _take(cache: PrefixCache, seq: _Seq, num_blocks: int) -> None:
    """Allocate the sequence's blocks up to `num_blocks`, from its promised ones."""
    while len(seq.table) < num_blocks:
        seq.table.append(cache.allocate()[0])
        seq.reserved -= 1


# ---- a hybrid pool: window blocks beside each block ---------------------------------

W, GROUPS = 5, 3  # windowed layers see 5 keys; a block of positions takes 3 blocks


def hybrid_cache(num_blocks: int) -> PrefixCache:
    return PrefixCache(num_blocks=num_blocks, block_size=BS, block_bytes=1,
                       window_groups=GROUPS - 1, window=W)


@dataclass
class _HybridSeq:
    prompt: list[int]
    version: int
    decoded: list[int]
    table: list[int] = field(default_factory=list)
    windows: list[list[int]] = field(default_factory=lambda: [[] for _ in range(GROUPS - 1)])
    tail: list[int] = field(default_factory=list)
    reserved: int = 0
    dropped: int = 0

    def blocks(self) -> list[int]:
        return [b for t in (self.table, *self.windows) for b in t if b] + self.tail

    def take(self, cache: PrefixCache, num_blocks: int) -> None:
        while len(self.table) < num_blocks:
            for t in (self.table, *self.windows):
                t.append(cache.allocate()[0])
                self.reserved -= 1


def run_hybrid(cache: PrefixCache, tokens: list[int], drop: int = 0) -> _HybridSeq:
    """One sequence computing `tokens` from scratch, releasing the window blocks of its
    first `drop` blocks (stale, as the scheduler does), then finishing."""
    seq = _HybridSeq(tokens, 0, [])
    need = -(-len(tokens) // BS)
    cache.reserve(need * GROUPS)
    seq.reserved = need * GROUPS
    seq.take(cache, need)
    cache.insert(tokens, 0, seq.table, len(tokens), finished=False, window_tables=seq.windows)
    for t in seq.windows:
        cache.release(t[:drop], stale=True)
        t[:drop] = [0] * drop
    cache.insert(tokens, 0, seq.table, len(tokens), finished=True, window_tables=seq.windows)
    cache.release(seq.blocks())
    return seq


def test_a_hit_needs_the_window_blocks_of_the_blocks_its_window_reaches() -> None:
    cache = hybrid_cache(64)
    tokens = list(range(100, 124))  # 6 blocks
    seq = run_hybrid(cache, tokens, drop=3)  # blocks 0-2's window blocks released, cached
    m = cache.match(tokens + [1], 0, 24)
    assert m.blocks == seq.table and m.num_tokens == 24
    # position 24's window reads keys 20..24: block 5 only
    assert m.window_blocks == [(), (), (), (), (), (seq.windows[0][5], seq.windows[1][5])]
    assert set(m.all_blocks()) == set(seq.table) | {seq.windows[0][5], seq.windows[1][5]}
    branch = tokens[:12] + [7, 7, 7, 7, 7]  # position 12 reads keys 8..12: block 2
    m = cache.match(branch, 0, 16)
    assert m.blocks == seq.table[:3] and m.window_blocks[:2] == [(), ()]
    assert m.window_blocks[2] == cache._entry_of[seq.table[2]].window_blocks != ()
    assert cache.evict(4) == 4  # the released ones go first: blocks 0 and 1's
    assert cache.match(branch, 0, 16).blocks == seq.table[:3]
    assert cache.evict(2) == 2  # block 2's: a hit after block 2, 1 or 0 would read them
    m = cache.match(branch, 0, 16)
    assert m.blocks == [] and m.num_tokens == 0 and m.claim is not None
    check_prefix_cache(cache)


def test_a_hit_stops_where_the_window_blocks_were_evicted_and_a_tail_needs_its_own() -> None:
    cache = hybrid_cache(64)
    tokens = list(range(100, 122))  # 5 full blocks and a part block of 2
    seq = run_hybrid(cache, tokens, drop=0)
    entry = cache._entry_of[seq.table[3]]
    cache._drop_window_blocks(entry)  # as eviction would, alone
    check_prefix_cache(cache)
    # position 22 reads keys 18..22: block 4 and the tail, not block 3
    m = cache.match(tokens + [1], 0, 22)
    assert m.num_tokens == 22 and m.blocks == seq.table[:5] and m.tail_block == seq.table[5]
    assert m.tail_window_blocks == (seq.windows[0][5], seq.windows[1][5])
    # a prompt of 18: after 4 blocks, position 16 would read block 3 (keys 12..16);
    # after 3, position 12 reads block 2 only; block 3 cannot be its tail either
    m = cache.match(tokens[:18] + [9], 0, 18)
    assert m.blocks == seq.table[:3] and m.num_tokens == 12 and m.tail_block is None


def test_a_block_computed_again_gives_its_entry_the_window_blocks_it_lost() -> None:
    cache = hybrid_cache(64)
    tokens = list(range(100, 116))  # 4 blocks
    first = run_hybrid(cache, tokens)
    lost = cache._entry_of[first.table[3]]
    cache._drop_window_blocks(lost)
    assert cache.match(tokens + [1], 0, 16).num_tokens == 12  # position 16 reads block 3
    again = run_hybrid(cache, tokens)  # as a hit cut short computes it again
    assert cache._entry_of[first.table[3]] is lost and again.table[3] not in cache._entry_of
    m = cache.match(tokens + [1], 0, 16)
    assert m.blocks == first.table and m.window_blocks[3] == lost.window_blocks != ()
    assert cache.evict(64) == 4 * GROUPS  # every entry, window blocks included, and
    assert cache.stats()["free_blocks"] == 63  # `again`'s own blocks were freed already
    check_prefix_cache(cache)


def test_released_window_blocks_are_evicted_before_older_finished_prefixes() -> None:
    cache = hybrid_cache(1 + 5 * GROUPS)  # room for 5 blocks of positions
    run_hybrid(cache, [1, 2, 3, 4, 5, 6, 7, 8])  # finished first: least recent
    new = run_hybrid(cache, [9] * 12, drop=2)  # its first 2 blocks' windows: stale
    assert cache.stats()["free_blocks"] == 0
    cache.reserve(4)
    freed = cache.evict(4)
    assert freed == 4  # the stale window blocks of `new`, not `old`'s entries
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 0], 0, 8).num_tokens == 8
    assert cache.match([9] * 12 + [0], 0, 12).num_tokens == 12  # its last window is kept
    assert all(not cache._entry_of[b].window_blocks for b in new.table[:2])
    check_prefix_cache(cache)


_hybrid_op = st.one_of(
    st.tuples(st.just("admit"), _prompts,
              st.lists(st.integers(0, 1), max_size=6), st.integers(0, 1), st.booleans()),
    st.tuples(st.sampled_from(["prefill", "drop", "finish", "evict"]), st.integers(0, 9),
              st.just([]), st.just(0), st.just(False)),
)


@given(st.lists(_hybrid_op, max_size=40), st.integers(4, 14))
def test_with_window_groups_promises_hold_and_hits_keep_their_window(
        ops: list[tuple], num_blocks: int) -> None:
    """The scheduler's protocol on a hybrid pool: a block of positions takes a block per
    group, running sequences release window blocks no window reads (stale), hits pin the
    window blocks of their first computed position's window. The invariants hold, every
    promise can be kept, and a hit has the window blocks it reads."""
    cache = hybrid_cache(num_blocks * GROUPS)
    admitted: list[_HybridSeq] = []
    running: list[_HybridSeq] = []
    for name, arg, decoded, version, reads in ops:
        if name == "admit":
            seq = _HybridSeq(arg, version, decoded)
            m = cache.match(arg, version, len(arg) - 1) if reads else pc.Match()
            first = max(0, m.num_tokens - W + 1) // BS
            assert all(bool(w) == (i >= first) for i, w in enumerate(m.window_blocks))
            assert m.tail_block is None or len(m.tail_window_blocks) == GROUPS - 1
            need = (-(-(len(arg) + len(decoded)) // BS) - len(m.blocks)) * GROUPS
            if cache.can_reserve(need, pinning=m.all_blocks()):
                cache.acquire(m.all_blocks())
                cache.reserve(need)
                seq.table, seq.reserved, seq.dropped = list(m.blocks), need, first
                seq.windows = [[w[g] if w else 0 for w in m.window_blocks]
                               for g in range(GROUPS - 1)]
                seq.tail = [] if m.tail_block is None else [m.tail_block, *m.tail_window_blocks]
                admitted.append(seq)
        elif name == "prefill" and admitted:
            seq = admitted.pop(arg % len(admitted))
            seq.take(cache, -(-len(seq.prompt) // BS))
            cache.insert(seq.prompt, seq.version, seq.table, len(seq.prompt), finished=False,
                         window_tables=seq.windows)
            cache.release(seq.tail)
            seq.tail = []
            running.append(seq)
        elif name == "drop" and running:
            seq = running[arg % len(running)]
            dead = min(len(seq.prompt) // BS, seq.dropped + 1)
            for t in seq.windows:
                cache.release(t[seq.dropped : dead], stale=True)
                t[seq.dropped : dead] = [0] * (dead - seq.dropped)
            seq.dropped = max(seq.dropped, dead)
        elif name == "finish" and running:
            seq = running.pop(arg % len(running))
            tokens = seq.prompt + seq.decoded
            seq.take(cache, -(-len(tokens) // BS))
            cache.insert(tokens, seq.version, seq.table, len(tokens), finished=True,
                         window_tables=seq.windows)
            cache.release(seq.blocks())
            cache.unreserve(seq.reserved)
        elif name == "evict":
            cache.evict(arg)
        refs: dict[int, int] = {}
        for s in admitted + running:
            for b in s.blocks():
                refs[b] = refs.get(b, 0) + 1
        check_prefix_cache(cache, refs)
        assert cache.reserved == sum(s.reserved for s in admitted + running)
        more = max(n for n in range(cache.num_blocks) if cache.can_reserve(n))
        trial = copy.deepcopy(cache)
        trial.reserve(more)
        for _ in range(trial.reserved):
            trial.allocate()
