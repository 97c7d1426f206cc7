"""The prefix cache: exact block-aligned prefix matches, refcounts, LRU within a budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefixgym.engine import prefix_cache as pc
from prefixgym.engine.prefix_cache import PrefixCache

L, H, D, BS = 2, 1, 2, 4


def make_cache(capacity_blocks: int = 64) -> PrefixCache:
    cache = PrefixCache(L, H, D, block_size=BS, capacity_bytes=0)
    cache.capacity_bytes = capacity_blocks * cache.block_bytes
    return cache


def kv_fn(tokens: list[int], version: int = 0):
    """KV whose values encode (version, block tokens), so a wrong hit is visible."""

    def kv_of_block(i: int) -> torch.Tensor:
        block = tokens[i * BS : (i + 1) * BS]
        value = float(version * 1000 + sum(block) + 7 * i)
        return torch.full((L, 2, H, BS, D), value)

    return kv_of_block


def test_match_returns_longest_block_aligned_prefix() -> None:
    cache = make_cache()
    tokens = list(range(11))  # two full blocks and a partial one
    chain = cache.insert(tokens, version=0, kv_of_block=kv_fn(tokens))
    assert len(chain) == 2 and len(cache) == 2
    assert cache.match_prefix(tokens, 0).num_tokens == 8
    assert cache.match_prefix(tokens[:7], 0).num_tokens == 4
    assert cache.match_prefix(tokens, 0, max_tokens=7).num_tokens == 4
    assert cache.match_prefix([0, 1, 2, 99] + tokens[4:], 0).num_tokens == 0
    assert cache.match_prefix(tokens[:4] + [99] + tokens[5:], 0).num_tokens == 4
    match = cache.match_prefix(tokens, 0)
    assert torch.equal(match.blocks[1].kv, kv_fn(tokens)(1))
    cache.check_integrity()


def test_other_weights_version_never_hits() -> None:
    cache = make_cache()
    tokens = list(range(8))
    cache.insert(tokens, version=0, kv_of_block=kv_fn(tokens))
    assert cache.match_prefix(tokens, version=1).num_tokens == 0
    cache.insert(tokens, version=1, kv_of_block=kv_fn(tokens, version=1))
    match = cache.match_prefix(tokens, version=1)
    assert match.num_tokens == 8
    assert all(b.version == 1 for b in match.blocks)
    assert match.blocks[0].kv[0, 0, 0, 0, 0].item() == 1000 + sum(range(4))


def test_hash_collision_is_verified_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "chain_key", lambda version, parent, tokens: 1)
    cache = make_cache()
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    cache.insert(a, 0, kv_fn(a))
    assert cache.match_prefix(b, 0).num_tokens == 0
    assert cache.insert(b, 0, kv_fn(b)) == []  # cannot be stored under a taken key
    assert cache.match_prefix(a, 0).num_tokens == 4


def test_referenced_blocks_are_not_evicted_and_insert_stops_when_full() -> None:
    cache = make_cache(capacity_blocks=2)
    a = list(range(8))
    chain = cache.insert(a, 0, kv_fn(a))
    cache.acquire(chain)
    assert not cache.can_insert(1)
    b = list(range(100, 108))
    assert cache.insert(b, 0, kv_fn(b)) == []
    assert cache.match_prefix(a, 0).num_tokens == 8
    cache.release(chain)
    assert cache.can_insert(2)
    assert len(cache.insert(b, 0, kv_fn(b))) == 2
    assert cache.match_prefix(a, 0).num_tokens == 0
    assert cache.stats()["evicted_blocks"] == 2
    cache.check_integrity()


def test_eviction_is_least_recently_used_leaf_first() -> None:
    cache = make_cache(capacity_blocks=3)
    a = list(range(8))  # blocks a0 <- a1
    b = list(range(50, 54))
    cache.insert(a, 0, kv_fn(a))
    cache.insert(b, 0, kv_fn(b))
    cache.insert(a, 0, kv_fn(a))  # refresh a: b is now the least recently used
    c = list(range(70, 74))
    cache.insert(c, 0, kv_fn(c))
    assert cache.match_prefix(b, 0).num_tokens == 0
    assert cache.match_prefix(a, 0).num_tokens == 8
    d = list(range(90, 94))
    cache.insert(d, 0, kv_fn(d))  # evicts the leaf a1 before its parent a0
    assert cache.match_prefix(a, 0).num_tokens == 4
    cache.check_integrity()


def test_release_without_acquire_is_refused() -> None:
    cache = make_cache()
    chain = cache.insert(list(range(4)), 0, kv_fn(list(range(4))))
    with pytest.raises(RuntimeError, match="not acquired"):
        cache.release(chain)
    cache.check_integrity()


def test_check_integrity_reports_broken_accounting() -> None:
    cache = make_cache()
    cache.insert(list(range(4)), 0, kv_fn(list(range(4))))
    cache.used_bytes += 1
    with pytest.raises(AssertionError, match="used_bytes"):
        cache.check_integrity()


def _expected_match(stored: set[tuple[int, tuple[int, ...]]], tokens: list[int], v: int) -> int:
    n = 0
    while n + BS <= len(tokens) and (v, tuple(tokens[: n + BS])) in stored:
        n += BS
    return n


op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 2), max_size=14), st.integers(0, 1)),
    st.tuples(st.just("match"), st.lists(st.integers(0, 2), max_size=14), st.integers(0, 1)),
    st.tuples(st.just("acquire"), st.lists(st.integers(0, 2), max_size=14), st.integers(0, 1)),
    st.tuples(st.just("release"), st.integers(0, 10), st.just(0)),
    st.tuples(st.just("evict"), st.integers(1, 3), st.just(0)),
)


@given(st.lists(op, max_size=40), st.integers(1, 5))
def test_random_operations_keep_invariants(ops: list[tuple], capacity_blocks: int) -> None:
    cache = make_cache(capacity_blocks)
    held: list[list[pc.Block]] = []
    for name, arg, version in ops:
        if name == "insert":
            chain = cache.insert(arg, version, kv_fn(arg, version))
            assert len(chain) <= len(arg) // BS
        elif name == "match":
            match = cache.match_prefix(arg, version)
            stored = {(b.version, _prefix_of(cache, b)) for b in cache._blocks.values()}
            assert match.num_tokens == _expected_match(stored, arg, version)
            for i, block in enumerate(match.blocks):
                assert torch.equal(block.kv, kv_fn(arg, version)(i))
        elif name == "acquire":
            match = cache.match_prefix(arg, version)
            cache.acquire(match.blocks)
            held.append(match.blocks)
        elif name == "release" and held:
            cache.release(held.pop(arg % len(held)))
        elif name == "evict":
            cache.evict(arg * cache.block_bytes)
        cache.check_integrity()
        for chain in held:  # referenced blocks are still cached
            assert all(cache._blocks.get(b.key) is b for b in chain)
        assert cache.used_bytes <= cache.capacity_bytes


def _prefix_of(cache: PrefixCache, block: pc.Block) -> tuple[int, ...]:
    tokens: tuple[int, ...] = ()
    while True:
        tokens = block.tokens + tokens
        if block.parent_key == 0:
            return tokens
        block = cache._blocks[block.parent_key]
