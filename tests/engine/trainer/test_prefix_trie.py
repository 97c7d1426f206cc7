"""prefix_trie: the plan computes each distinct prefix position once, every datum's
positions map to rows holding its tokens, contexts are earlier rows, budgets hold."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from prefixgym.engine.trainer.prefix_trie import (
    TriePlan,
    plan_chunks,
    shard_by_prefix,
    sorted_with_lcp,
)


def distinct_prefixes(tokens: list[list[int]]) -> int:
    return len({tuple(t[: k + 1]) for t in tokens for k in range(len(t))})


def check_plan(plan: TriePlan, tokens: list[list[int]]) -> None:
    """Every cell's row holds the datum's token at its position; every context row holds
    the segment's earlier tokens and was computed by an earlier wave."""
    stored_tokens: list[torch.Tensor] = []
    stored_positions: list[torch.Tensor] = []
    picked_tokens, picked_positions = [], []
    for wave in plan.waves:
        flat_tokens = wave.tokens_N_L.reshape(-1)
        flat_positions = wave.positions_N_L.reshape(-1)
        if wave.context_N_A is not None:
            assert wave.mask_N_1_L_K is not None
            store_tokens = torch.cat(stored_tokens)
            store_positions = torch.cat(stored_positions)
            assert int(wave.context_N_A.max()) < store_tokens.numel()  # earlier waves only
            for k in range(wave.tokens_N_L.shape[0]):
                start = int(wave.positions_N_L[k, 0])
                visible = wave.mask_N_1_L_K[k, 0, 0, : wave.context_N_A.shape[1]]
                assert int(visible.sum()) == start and bool(visible[:start].all())
                rows = wave.context_N_A[k, :start]
                assert torch.equal(store_positions[rows], torch.arange(start))
                prefix = store_tokens[rows]
                # some datum has this context followed by this segment's tokens
                segment = wave.tokens_N_L[k]
                assert any(t[:start] == prefix.tolist()
                           and t[start:start + 1] == segment[:1].tolist() for t in tokens)
        else:
            assert wave.mask_N_1_L_K is None
            assert int(wave.positions_N_L[:, 0].abs().sum()) == 0  # level 0 starts at 0
        if wave.stored:
            stored_tokens.append(flat_tokens)
            stored_positions.append(flat_positions)
        picked_tokens.append(flat_tokens[wave.rows_used])
        picked_positions.append(flat_positions[wave.rows_used])
    picked_tokens.append(torch.tensor([-1]))
    picked_positions.append(torch.tensor([-1]))
    grid_tokens = torch.cat(picked_tokens)[plan.order_B_T]
    grid_positions = torch.cat(picked_positions)[plan.order_B_T]
    for b, i in enumerate(plan.indices):
        n = len(tokens[i])
        assert grid_tokens[b, :n].tolist() == tokens[i]
        assert grid_positions[b, :n].tolist() == list(range(n))
        assert bool((grid_tokens[b, n:] == -1).all())  # padding reads the zero at the end


def test_an_extension_sorts_before_its_prefix_and_lcps_are_with_the_predecessor() -> None:
    tokens = [[1, 2], [1, 2, 3], [1, 2, 4], [0, 9], [1, 2]]
    order, lcps = sorted_with_lcp(tokens)
    assert order == [3, 1, 2, 0, 4]
    assert lcps == [0, 0, 2, 2, 2]


def test_a_group_sharing_a_prompt_computes_it_once() -> None:
    prompt = list(range(10, 30))
    tokens = [prompt + [1, 2, 3], prompt + [4, 5], prompt + [1, 2, 6, 7], prompt + [1, 2, 6, 8],
              prompt]
    (plan,) = plan_chunks(tokens, budget=10_000, context_weight=0.1)
    assert plan.computed_tokens == 20 + 3 + 2 + 2 + 1 == distinct_prefixes(tokens)
    assert plan.indices == [0, 2, 3, 1, 4]  # an extension before its prefix
    # level 0: a whole datum; level 1: [6, 7] and [4, 5] in one wave; level 2: [8], which
    # reads [6] of the level-1 branch
    assert [w.tokens_N_L.tolist() for w in plan.waves] == [
        [[*prompt, 1, 2, 3]], [[6, 7], [4, 5]], [[8]]]
    assert [w.stored for w in plan.waves] == [True, True, False]
    check_plan(plan, tokens)


def test_no_shared_prefix_is_one_wave_per_length_class_without_context() -> None:
    tokens = [[1, 2, 3], [2, 3], [3, 4, 5, 6], [4]]
    (plan,) = plan_chunks(tokens, budget=10_000, context_weight=0.1)
    assert plan.computed_tokens == 10
    assert all(w.context_N_A is None and not w.stored for w in plan.waves)
    check_plan(plan, tokens)


def test_duplicates_compute_nothing_new() -> None:
    tokens = [[5, 6, 7], [5, 6, 7], [5, 6, 7]]
    (plan,) = plan_chunks(tokens, budget=100, context_weight=0.1)
    assert plan.computed_tokens == 3 and len(plan.waves) == 1
    check_plan(plan, tokens)


def test_a_trie_over_the_budget_is_cut_between_sorted_neighbours() -> None:
    prompt = list(range(100, 140))  # 40 tokens
    tokens = [prompt + [i, i + 1] for i in range(10)]  # 40 + 10 x 2 = 60 distinct
    plans = plan_chunks(tokens, budget=50, context_weight=0.0)
    assert len(plans) == 2
    assert sorted(i for p in plans for i in p.indices) == list(range(10))
    for p in plans:
        assert p.cost(0.0) <= 50
        assert p.computed_tokens == 40 + 2 * len(p.indices)  # the prompt once per chunk
        check_plan(p, tokens)
    # a datum longer than the budget still gets a chunk of its own
    (alone,) = plan_chunks([list(range(80))], budget=50, context_weight=0.0)
    assert alone.computed_tokens == 80


def test_context_rows_count_against_the_budget() -> None:
    prompt = list(range(100, 140))
    tokens = [prompt + [i] for i in range(10)]  # 50 positions; 9 branches x 40 context rows
    assert len(plan_chunks(tokens, budget=60, context_weight=0.0)) == 1
    heavy = plan_chunks(tokens, budget=60, context_weight=0.5)
    assert len(heavy) > 1 and all(p.cost(0.5) <= 60 for p in heavy)


trie_tokens = st.lists(
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 5), max_size=12)),
    min_size=1, max_size=12,
)
TRUNKS = [[], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [7] * 10]


@given(trie_tokens, st.integers(1, 60), st.sampled_from([0.0, 0.25, 1.0]))
def test_any_datum_set_plans_exactly(spec: list[tuple[int, list[int]]], budget: int,
                                     weight: float) -> None:
    tokens = [TRUNKS[t] + tail or [0] for t, tail in spec]
    plans = plan_chunks(tokens, budget, weight)
    assert sorted(i for p in plans for i in p.indices) == list(range(len(tokens)))
    for p in plans:
        assert len(p.indices) == 1 or p.cost(weight) <= budget
        assert p.computed_tokens == distinct_prefixes([tokens[i] for i in p.indices])
        check_plan(p, tokens)
    if len(plans) == 1:
        assert plans[0].computed_tokens == distinct_prefixes(tokens)


@given(trie_tokens, st.integers(1, 4))
def test_shards_partition_the_trie_order_in_runs(spec: list[tuple[int, list[int]]],
                                                 world: int) -> None:
    tokens = [TRUNKS[t] + tail or [0] for t, tail in spec]
    shards = shard_by_prefix(tokens, world)
    order, _ = sorted_with_lcp(tokens)
    assert len(shards) == world
    assert [i for s in shards for i in s] == order  # contiguous runs, in trie order
