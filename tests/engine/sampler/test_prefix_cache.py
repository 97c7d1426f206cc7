"""The block manager and prefix index: prefix matches down to the token, refcounts,
reservations, LRU leaf-first eviction, versions."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from prefixgym.engine.sampler import prefix_cache as pc
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
    cache.check_integrity()


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
    cache.check_integrity()


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
    cache.check_integrity()


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
    cache.check_integrity()


def test_check_integrity_reports_broken_accounting() -> None:
    cache = PrefixCache(num_blocks=8, block_size=BS, block_bytes=1)
    table = run_sequence(cache, [1, 2, 3, 4], keep=True)
    with pytest.raises(AssertionError, match="sequences hold 0"):
        cache.check_integrity(refs={})
    cache.check_integrity(refs={table[0]: 1})
    cache.reserved = 100
    with pytest.raises(AssertionError, match="reserved"):
        cache.check_integrity()


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
    cache.check_integrity()


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
        cache.check_integrity(refs={b: n for b, n in refs.items() if n})


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
        cache.check_integrity(refs)
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
