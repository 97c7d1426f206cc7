"""The engine: cache reuse, shared prefill, prompt logprobs, versions, seeds, stops, errors.

The cache's property tests run twice: on full attention, and on a model whose first layer
has a sliding window shorter than a block and its own RoPE base (Gemma 3's layout)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgym.engine.model import ModelConfig, Transformer
from prefixgym.engine.sampler.admission import PATIENCE
from prefixgym.local_service import LocalService
from prefixgym.types import ModelInput, SampleRequest, SampleResponse, SamplingParams

SMALL = ModelConfig(vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    hidden_dim=128, max_seq_len=512)
WINDOWED = dataclasses.replace(SMALL, layer_windows=(7, 0), local_rope_theta=500.0)
ALL_WINDOWED = dataclasses.replace(SMALL, layer_windows=(20, 12))  # blocks fall out of both
# a hybrid model (a full layer between two windowed ones): a block of positions takes a
# block in each of 3 groups, and the windowed groups' blocks fall out of their windows
HYBRID = dataclasses.replace(SMALL, n_layers=3, layer_windows=(20, 0, 12))
BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def service() -> Iterator[LocalService]:
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        yield svc


@pytest.fixture(scope="module")
def uncached() -> Iterator[LocalService]:
    with LocalService(SMALL, seed=0, block_size=BS, prefix_cache=False) as svc:
        yield svc


@pytest.fixture(scope="module")
def windowed() -> Iterator[tuple[LocalService, LocalService]]:
    """A windowed model's engine with its prefix cache, and one without."""
    with LocalService(WINDOWED, seed=0, block_size=BS) as cached, \
            LocalService(WINDOWED, seed=0, block_size=BS, prefix_cache=False) as plain:
        yield cached, plain


@pytest.fixture(scope="module")
def all_windowed() -> Iterator[tuple[LocalService, LocalService]]:
    """A model whose every layer is windowed: sequences drop the blocks no window reads."""
    small = {"block_size": BS, "cache_bytes": 1 << 22}  # 256 blocks: cheap integrity checks
    with LocalService(ALL_WINDOWED, seed=0, **small) as cached, \
            LocalService(ALL_WINDOWED, seed=0, prefix_cache=False, **small) as plain:
        yield cached, plain


@pytest.fixture(scope="module")
def hybrid() -> Iterator[tuple[LocalService, LocalService]]:
    """A hybrid model's engines, with its prefix cache and without."""
    small = {"block_size": BS, "cache_bytes": 1 << 22}
    with LocalService(HYBRID, seed=0, **small) as cached, \
            LocalService(HYBRID, seed=0, prefix_cache=False, **small) as plain:
        yield cached, plain


def full_forward_logprobs(model: Transformer, tokens: list[int]) -> list[float | None]:
    """log p(tokens[i] | tokens[:i]) from one plain causal forward (no KV view)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0]
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return [None, *logp.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1).tolist()]


def run_turns(svc: LocalService, first: list[int], extra: list[list[int]], params: SamplingParams):
    sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
    prompt, out = list(first), []
    for more in [[], *extra]:
        prompt = prompt + more
        resp = sampler.sample(ModelInput.from_ints(prompt), sampling_params=params).result()
        out.append((list(prompt), resp))
        prompt = prompt + resp.sequences[0].tokens
    return out


tokens = st.lists(st.integers(1, 4000), min_size=1, max_size=40)
LONG_TURNS = {"first": st.lists(st.integers(1, 4000), min_size=1, max_size=60),
              "extra": st.lists(tokens, min_size=1, max_size=3)}
"""A first prompt of up to 60 tokens (several windows and blocks), then 1-3 turns."""


@settings(max_examples=6, derandomize=True)
@given(first=tokens, extra=st.lists(tokens, min_size=1, max_size=3))
def test_cached_and_uncached_agree_and_turns_hit_the_cache(
    service: LocalService, uncached: LocalService, first: list[int], extra: list[list[int]]
) -> None:
    check_turns(service, uncached, first, extra)


@settings(max_examples=6, derandomize=True, deadline=None)
@given(**LONG_TURNS)
def test_with_sliding_windows_cached_and_uncached_agree_and_turns_hit_the_cache(
    windowed: tuple[LocalService, LocalService], first: list[int], extra: list[list[int]]
) -> None:
    turns = check_turns(*windowed, first, extra)
    model = windowed[0].train_model
    for prompt, resp in turns:  # decode steps give the plain forward's logprobs
        seq = resp.sequences[0]
        full = full_forward_logprobs(model, prompt + seq.tokens)
        assert seq.logprobs == pytest.approx(full[len(prompt):], abs=1e-4)
    prompt = first + extra[0]
    with torch.no_grad():  # the window is exercised: a model without it answers otherwise
        unwindowed = Transformer(SMALL)
        unwindowed.load_state_dict(model.state_dict())
    if len(prompt) > 7:
        assert full_forward_logprobs(unwindowed, prompt) != full_forward_logprobs(model, prompt)


LONG = SamplingParams(max_tokens=40, temperature=0.0)


@contextlib.contextmanager
def integrity_checked_every_step(svc: LocalService) -> Iterator[list[str]]:
    """The cache's invariants checked after every engine step, on the engine thread
    (while sequences run, not only once they are done); the broken ones are listed."""
    engine, broken = svc.engine, []
    step = engine.step

    def checked_step() -> None:
        step()
        try:
            engine.scheduler.check_integrity()
        except AssertionError as error:
            broken.append(str(error))

    engine.step = checked_step  # type: ignore[method-assign]
    try:
        yield broken
    finally:
        engine.step = step  # type: ignore[method-assign]


@pytest.fixture(scope="module", params=["every layer windowed", "hybrid"])
def dropping(request: pytest.FixtureRequest) -> tuple[LocalService, LocalService]:
    """The engines of a model that drops blocks no window reads: every layer's, or the
    windowed layers' of a hybrid model (a block table per layer kind)."""
    return request.getfixturevalue("all_windowed" if request.param.startswith("every")
                                   else "hybrid")


@settings(max_examples=6, derandomize=True, deadline=None)
@given(**LONG_TURNS)
def test_blocks_no_window_reads_are_dropped_and_turns_still_hit_the_cache(
    dropping: tuple[LocalService, LocalService], first: list[int], extra: list[list[int]]
) -> None:
    """Replies of 40 tokens on windows of 12 and 20: each sequence drops blocks as it
    decodes (indexing them first; a hybrid model its windowed layers' blocks, the full
    layer keeping every one), and the next turn, which extends it, still hits them all;
    every logprob is the plain forward's."""
    cached, plain = dropping
    hybrid = cached.train_model.config == HYBRID
    assert cached.engine.runner.pool.layout.groups == (3 if hybrid else 1)
    before = cached.engine_stats()["window_dropped_blocks"]
    with integrity_checked_every_step(cached) as broken:
        turns = check_turns(cached, plain, first, extra, LONG)
    assert broken == []
    assert cached.engine_stats()["window_dropped_blocks"] > before
    for prompt, resp in turns:
        seq = resp.sequences[0]
        full = full_forward_logprobs(cached.train_model, prompt + seq.tokens)
        assert seq.logprobs == pytest.approx(full[len(prompt):], abs=1e-4)


@pytest.mark.parametrize("num_samples", [1, 3])
def test_without_the_cache_every_block_out_of_the_window_is_freed(
        all_windowed: tuple[LocalService, LocalService], num_samples: int) -> None:
    _, plain = all_windowed
    P, N, W = 37, 60, 20
    prompt = list(range(5, 5 + P))
    before = plain.engine_stats()["window_dropped_blocks"]
    resp = plain.create_sampling_client(stop_at_end_of_turn=False).sample(
        prompt, num_samples=num_samples, sampling_params=SamplingParams(
            max_tokens=N, temperature=1.0, seed=3)).result()
    last_kv_len = P + N - 2  # the last decode step's position
    dead = (last_kv_len - W + 1) // BS  # blocks entirely at or before it minus the window
    shared = P // BS  # the samples' shared prompt blocks count once per sample too
    assert plain.engine_stats()["window_dropped_blocks"] - before == num_samples * dead
    assert dead > shared
    for seq in resp.sequences:
        full = full_forward_logprobs(plain.train_model, prompt + seq.tokens)
        assert seq.logprobs == pytest.approx(full[P:], abs=1e-4)
    plain.check_cache_integrity()


def check_turns(service: LocalService, uncached: LocalService, first: list[int],
                extra: list[list[int]], params: SamplingParams = GREEDY
                ) -> list[tuple[list[int], SampleResponse]]:
    cached_turns = run_turns(service, first, extra, params)
    plain_turns = run_turns(uncached, first, extra, params)
    previous_shared = 0
    for (prompt, a), (_, b) in zip(cached_turns, plain_turns):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        assert a.sequences[0].logprobs == pytest.approx(b.sequences[0].logprobs, abs=1e-5)
        assert a.usage.prefill_computed_tokens + a.usage.prefill_cached_tokens == len(prompt)
        assert b.usage.prefill_cached_tokens == 0
        # every position the previous turn stored is reused, partial last block included
        assert a.usage.prefill_cached_tokens >= previous_shared - 1
        previous_shared = len(prompt) + len(a.sequences[0].tokens)
    service.check_cache_integrity()
    return cached_turns


@contextlib.contextmanager
def running_blocks_every_step(svc: LocalService) -> Iterator[list[int]]:
    """The pool's blocks held by running sequences, after every engine step."""
    engine, seen = svc.engine, []
    step = engine.step

    def recorded_step() -> None:
        step()
        seen.append(engine.cache.stats()["running_blocks"])

    engine.step = recorded_step  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        engine.step = step  # type: ignore[method-assign]


def test_a_hybrid_model_holds_only_the_window_blocks_its_windows_read(
        hybrid: tuple[LocalService, LocalService]) -> None:
    """One sample of 60 tokens after a prompt of 37: at each decode step its full layer
    holds every block, each windowed group only the blocks from the one its widest
    window (20) reaches: 12 blocks at most where keeping them all takes 18, as the
    pool's figures say."""
    _, plain = hybrid
    P, N, W = 37, 60, 20
    with running_blocks_every_step(plain) as seen:
        resp = plain.create_sampling_client(stop_at_end_of_turn=False).sample(
            list(range(5, 5 + P)), num_samples=1, sampling_params=SamplingParams(
                max_tokens=N, temperature=1.0, seed=3)).result()
    expected = [-(-P // BS) * 3]  # after the prefill: the prompt's blocks in 3 groups
    for k in range(1, N - 1):  # decode steps; the last one finishes and frees
        kv_len = P + k - 1
        blocks, dead = kv_len // BS + 1, max(0, (kv_len - W + 1) // BS)
        expected.append(blocks + 2 * (blocks - dead))
    assert seen == [*expected, 0]
    assert max(seen) == 12 < 3 * -(-(P + N - 1) // BS) == 18
    full = full_forward_logprobs(plain.train_model, list(range(5, 5 + P)) + resp.sequences[0].tokens)
    assert resp.sequences[0].logprobs == pytest.approx(full[P:], abs=1e-4)
    assert plain.engine.cache.stats()["running_blocks"] == 0
    plain.check_cache_integrity()


@pytest.mark.parametrize("num_samples", [1, 3])
def test_a_hybrid_group_shares_its_prompt_and_drops_per_sample(
        hybrid: tuple[LocalService, LocalService], num_samples: int) -> None:
    cached, plain = hybrid
    P, N, W = 45, 50, 20
    prompt = list(range(100 * num_samples, 100 * num_samples + P))  # uncached
    params = SamplingParams(max_tokens=N, temperature=1.0, seed=11)
    before = cached.engine_stats()["window_dropped_blocks"]
    with integrity_checked_every_step(cached) as broken:
        a = cached.create_sampling_client(stop_at_end_of_turn=False).sample(
            prompt, num_samples=num_samples, sampling_params=params).result()
    b = plain.create_sampling_client(stop_at_end_of_turn=False).sample(
        prompt, num_samples=num_samples, sampling_params=params).result()
    assert broken == []
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    dead = (P + N - 2 - W + 1) // BS
    assert cached.engine_stats()["window_dropped_blocks"] - before == num_samples * dead
    again = cached.create_sampling_client(stop_at_end_of_turn=False).sample(
        prompt, num_samples=num_samples, sampling_params=params).result()
    assert again.usage.prefill_cached_tokens == P - 1  # the released windows still serve
    assert [s.tokens for s in again.sequences] == [s.tokens for s in a.sequences]


@settings(max_examples=5, derandomize=True, deadline=None)
@given(base=st.lists(st.integers(1, 4000), min_size=20, max_size=60),
       cuts=st.lists(st.tuples(st.integers(0, 60), tokens, st.integers(1, 3)),
                     min_size=2, max_size=6))
def test_cached_and_uncached_agree_when_prompts_diverge_inside_blocks(
    service: LocalService, uncached: LocalService, base: list[int],
    cuts: list[tuple[int, list[int], int]]
) -> None:
    check_diverging(service, uncached, base, cuts)


@settings(max_examples=5, derandomize=True, deadline=None)
@given(base=st.lists(st.integers(1, 4000), min_size=20, max_size=60),
       cuts=st.lists(st.tuples(st.integers(0, 60), tokens, st.integers(1, 3)),
                     min_size=2, max_size=6))
def test_with_sliding_windows_cached_and_uncached_agree_when_prompts_diverge(
    windowed: tuple[LocalService, LocalService], base: list[int],
    cuts: list[tuple[int, list[int], int]]
) -> None:
    check_diverging(*windowed, base, cuts)


def check_diverging(service: LocalService, uncached: LocalService, base: list[int],
                    cuts: list[tuple[int, list[int], int]]) -> None:
    """Prompts that share a prefix of any length (so hits end mid-block, on full and on
    partial blocks), G samples each, in two rounds submitted atomically: the cache
    changes nothing but the counts."""
    prompts = [base[:cut] + tail for cut, tail, _ in cuts]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    results = []
    for svc in (service, uncached):
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        rounds = []
        for _ in range(2):
            futures = [sampler.sample_many([SampleRequest(p, g, params)])[0]
                       for p, (_, _, g) in zip(prompts, cuts)]
            rounds.append([f.result() for f in futures])
            svc.check_cache_integrity()
        results.append(rounds)
    for cached_round, plain_round in zip(*results):
        for prompt, a, b in zip(prompts, cached_round, plain_round):
            assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
            for sa, sb in zip(a.sequences, b.sequences):
                assert sa.logprobs == pytest.approx(sb.logprobs, abs=1e-5)
            assert a.usage.prefill_computed_tokens + a.usage.prefill_cached_tokens == len(prompt)
    for prompt, again in zip(prompts, results[0][1]):  # round 2 finds all but the last token,
        # or all of it where it joined an identical prompt of its wave
        assert again.usage.prefill_cached_tokens in (len(prompt) - 1, len(prompt))


def test_group_of_eight_prefills_the_prompt_once(service: LocalService) -> None:
    prompt = list(range(3000, 3050))
    before = service.engine_stats()["prefill_positions"]
    resp = service.create_sampling_client().sample(
        prompt, num_samples=8, sampling_params=SamplingParams(max_tokens=5, seed=1)
    ).result()
    assert len(resp.sequences) == 8
    assert resp.usage.prefill_computed_tokens == 50 and resp.usage.prefill_cached_tokens == 0
    assert service.engine_stats()["prefill_positions"] - before == 50
    assert resp.usage.sampled_tokens == sum(len(s.tokens) for s in resp.sequences)
    assert len({tuple(s.tokens) for s in resp.sequences}) > 1  # per-sample randomness


def test_identical_prompts_of_a_wave_are_prefilled_once_and_draw_what_their_seeds_fix(
        uncached: LocalService) -> None:
    """Requests with one prompt, in one round: the first computes it, the others join
    its prefill (nothing computed, all cached) and still draw from their own seeds:
    each gives what it gives alone on an engine that computes every prompt. A request
    scoring its prompt computes it itself."""
    prompt = list(range(2000, 2040))  # 2.5 blocks: a part-filled last block to copy
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 3, 4)]
    scored = SamplingParams(max_tokens=2, temperature=0.0)
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        with integrity_checked_every_step(svc) as broken:
            svc.engine.pause()  # one wave
            futures = [sampler.sample(prompt, num_samples=2, sampling_params=p) for p in params]
            futures.append(sampler.sample(prompt, sampling_params=scored,
                                          include_prompt_logprobs=True))
            svc.engine.resume()
            joined = [f.result() for f in futures]
        assert broken == []
        stats = svc.engine_stats()
        assert stats["joined_requests"] == 3
        assert stats["prefill_positions"] == 2 * len(prompt)  # once sampled, once scored
        svc.check_cache_integrity()
    assert joined[0].usage.prefill_computed_tokens == len(prompt)
    for resp in joined[1:4]:
        assert resp.usage.prefill_computed_tokens == 0
        assert resp.usage.prefill_cached_tokens == resp.prompt_cache_hit_tokens == len(prompt)
    assert joined[4].usage.prefill_computed_tokens == len(prompt)
    alone_sampler = uncached.create_sampling_client(stop_at_end_of_turn=False)
    for p, resp in zip(params, joined):
        alone = alone_sampler.sample(prompt, num_samples=2, sampling_params=p).result()
        assert [s.tokens for s in resp.sequences] == [s.tokens for s in alone.sequences]
        for a, b in zip(resp.sequences, alone.sequences):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert len({tuple(s.tokens) for r in joined[:4] for s in r.sequences}) > 1


def test_prompt_logprobs_skip_the_cache_and_match_a_full_forward(service: LocalService) -> None:
    sampler = service.create_sampling_client()
    prompt = list(range(100, 170))
    sampler.sample(prompt, sampling_params=SamplingParams(max_tokens=1)).result()  # now cached
    hits = service.cache_stats()["hit_tokens"]
    expected = full_forward_logprobs(sampler._model, prompt)
    resp = sampler.sample(prompt, sampling_params=GREEDY, include_prompt_logprobs=True).result()
    assert resp.usage.prefill_cached_tokens == 0 and resp.usage.prefill_computed_tokens == 70
    assert resp.prompt_logprobs is not None and resp.prompt_logprobs[0] is None
    assert resp.prompt_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
    logprobs = sampler.compute_logprobs(ModelInput.from_ints(prompt)).result()
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
    assert service.cache_stats()["hit_tokens"] == hits


def test_a_new_weights_version_never_hits_old_blocks() -> None:
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        prompt = list(range(200, 260))
        old = svc.create_sampling_client()
        old.sample(prompt, sampling_params=GREEDY).result()
        assert old.sample(prompt, sampling_params=GREEDY).result().usage.prefill_cached_tokens == 59  # all but the last token: partial blocks too
        new = svc.publish_weights()
        assert (new.weights_version, svc.weights_version) == (1, 1)
        first = new.sample(prompt, sampling_params=GREEDY).result()
        assert first.usage.prefill_cached_tokens == 0
        assert new.sample(prompt, sampling_params=GREEDY).result().usage.prefill_cached_tokens == 59
        assert old.sample(prompt, sampling_params=GREEDY).result().usage.prefill_cached_tokens == 59


def test_a_small_pool_queues_requests_evicts_and_gives_the_same_results() -> None:
    block_bytes = 2 * SMALL.n_layers * SMALL.n_kv_heads * BS * SMALL.head_dim * 4
    prompts = [list(range(i * 50 + 1, i * 50 + 41)) for i in range(6)]
    params = [SamplingParams(max_tokens=20, seed=i) for i in range(6)]
    results = []
    for pool_blocks in (14, 4096):  # 13 usable: two requests of 6 blocks at a time
        with LocalService(SMALL, seed=0, block_size=BS, cache_bytes=pool_blocks * block_bytes) as svc:
            sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
            futures = sampler.sample_many([SampleRequest(p, 2, q) for p, q in zip(prompts, params)])
            results.append([[s.tokens for s in f.result().sequences] for f in futures])
            svc.check_cache_integrity()
            stats = svc.cache_stats()
            assert stats["used_bytes"] <= stats["capacity_bytes"]
            assert stats["referenced_blocks"] == stats["reserved_blocks"] == 0
            if pool_blocks == 14:
                assert stats["evicted_blocks"] > 0
                with pytest.raises(ValueError, match="KV pool holds 13"):
                    sampler.sample(list(range(1, 200)), sampling_params=params[0])
    assert results[0] == results[1]


def test_a_small_hybrid_pool_evicts_window_blocks_and_gives_the_same_results() -> None:
    """Four conversations on one 40-token prefix, two turns each, then the prefix's own
    branches again, in a pool of 14 blocks of positions: the released window blocks and
    then finished prefixes are evicted, hits stop where a window lost its blocks, and
    every token is the one an engine without a cache samples."""
    block_bytes = 2 * HYBRID.n_kv_heads * BS * HYBRID.head_dim * 4  # one layer per group
    shared = list(range(1000, 1040))
    firsts = [shared + [7 * i + 1, 7 * i + 2] for i in range(4)]
    params = SamplingParams(max_tokens=30, temperature=0.0)
    results = []
    for pool_blocks, cache in ((1 + 3 * 14, True), (4096, False)):
        with LocalService(HYBRID, seed=0, block_size=BS, prefix_cache=cache,
                          cache_bytes=pool_blocks * block_bytes) as svc, \
                integrity_checked_every_step(svc) as broken:
            sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
            out = []
            prompts = firsts
            for turn in range(3):
                futures = sampler.sample_many([SampleRequest(p, 1, params) for p in prompts])
                replies = [f.result().sequences[0].tokens for f in futures]
                out.append(replies)
                prompts = ([p + r + [turn + 5] for p, r in zip(prompts, replies)] if turn == 0
                           else [shared[:16 + 8 * i] + [9] for i in range(4)])
            results.append(out)
            assert broken == []
            stats = svc.cache_stats()
            assert stats["referenced_blocks"] == stats["reserved_blocks"] == 0
            if cache:
                assert stats["evicted_blocks"] > 0 and stats["hit_tokens"] > 0
    assert results[0] == results[1]


def test_a_request_that_bypasses_the_cache_leaves_its_cached_prefix_evictable() -> None:
    # A prompt-scoring request computes its whole prompt, though its first two blocks
    # are cached; while it decodes, those cached blocks (unreferenced) must stay
    # evictable, since the request admitted with it counted on them. The pool holds 9.
    block_bytes = 2 * SMALL.n_layers * SMALL.n_kv_heads * BS * SMALL.head_dim * 4
    cached = list(range(1, 2 * BS + 1))
    scoring = (cached + list(range(500, 500 + BS)), SamplingParams(max_tokens=17, seed=1))  # 4 blocks
    other = (list(range(1000, 1070)), SamplingParams(max_tokens=11, seed=2))  # 5 blocks
    results = []
    for pool_blocks in (10, 4096):
        with LocalService(SMALL, seed=0, block_size=BS, cache_bytes=pool_blocks * block_bytes) as svc:
            sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
            sampler.sample(cached, sampling_params=SamplingParams(max_tokens=1)).result()
            svc.engine.pause()  # one wave: both promised their blocks before either runs
            futures = [sampler.sample(scoring[0], sampling_params=scoring[1],
                                      include_prompt_logprobs=True),
                       sampler.sample(other[0], sampling_params=other[1])]
            svc.engine.resume()
            responses = [f.result(timeout=60) for f in futures]
            results.append([(r.sequences[0].tokens, r.prompt_logprobs) for r in responses])
            svc.check_cache_integrity()
            assert svc.engine_stats()["requests_failed"] == 0
            assert svc.cache_stats()["reserved_blocks"] == 0
            if pool_blocks == 10:
                assert svc.cache_stats()["evicted_blocks"] > 0
    assert results[0] == results[1]


def admitted_in_order(pool_blocks: int, prompts: dict[str, list[int]],
                      first: list[int]) -> tuple[list[str], dict[str, int]]:
    """Cache `first`, then queue `prompts` (in their order) in one wave into a pool of
    `pool_blocks` blocks (one of them padding): the order they finished in and each one's
    cached prompt tokens. A pool that runs one at a time finishes them as admitted."""
    block_bytes = 2 * SMALL.n_layers * SMALL.n_kv_heads * BS * SMALL.head_dim * 4
    params = SamplingParams(max_tokens=12, seed=3)
    with LocalService(SMALL, seed=0, block_size=BS, cache_bytes=pool_blocks * block_bytes) as svc:
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        sampler.sample(first, sampling_params=SamplingParams(max_tokens=1)).result()
        finished: list[str] = []
        svc.engine.pause()
        futures = {}
        for name, prompt in prompts.items():
            futures[name] = sampler.sample(prompt, sampling_params=params)
            futures[name].future().add_done_callback(lambda _, name=name: finished.append(name))
        svc.engine.resume()
        cached = {n: f.result(timeout=60).usage.prefill_cached_tokens for n, f in futures.items()}
        svc.check_cache_integrity()
    return finished, cached


def test_a_full_pool_admits_the_request_with_the_longest_cached_prefix_first() -> None:
    # 9 usable blocks; "fresh" (first in the queue) needs 6, "cached" extends the 4
    # cached blocks of `first` and needs 2 more: both do not fit. Arrival order would
    # run "fresh" first, whose blocks evict part of the cached prefix.
    first = list(range(1, 4 * BS + 1))
    prompts = {"fresh": list(range(100, 184)), "cached": first + list(range(300, 320))}
    finished, cached = admitted_in_order(10, prompts, first)
    assert finished == ["cached", "fresh"]
    assert cached == {"cached": 4 * BS, "fresh": 0}


def test_a_request_passed_over_for_cached_ones_goes_first_after_its_patience() -> None:
    # 7 usable blocks: one request at a time. "fresh" arrived first, with no cached
    # prefix; the others all extend the cached `first`, so each wave prefers one of
    # them until "fresh" has been passed over PATIENCE times.
    first = list(range(1, 4 * BS + 1))
    prompts = {"fresh": list(range(100, 184))}
    prompts |= {f"cached{i}": first + list(range(300 + 20 * i, 320 + 20 * i))
                for i in range(PATIENCE + 1)}
    finished, cached = admitted_in_order(8, prompts, first)
    assert finished == [f"cached{i}" for i in range(PATIENCE)] + ["fresh", f"cached{PATIENCE}"]
    assert all(cached[f"cached{i}"] == 4 * BS for i in range(PATIENCE))


def test_seeds_reproduce_while_other_requests_share_the_batch(service: LocalService) -> None:
    sampler = service.create_sampling_client(stop_at_end_of_turn=False)
    params = SamplingParams(max_tokens=15, temperature=1.0, top_k=50, top_p=0.9, seed=42)
    alone = sampler.sample(list(range(10, 30)), sampling_params=params).result()
    results: list[list[int]] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        noise = sampler.sample([i + 1] * 25, sampling_params=SamplingParams(max_tokens=20, seed=i))
        mine = sampler.sample(list(range(10, 30)), sampling_params=params)
        with lock:
            results.append(mine.result().sequences[0].tokens)
        noise.result()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [alone.sequences[0].tokens] * 4


def test_concurrent_requests_are_batched() -> None:
    with LocalService(SMALL, seed=0) as svc:
        sampler = svc.create_sampling_client()
        svc.engine.pause()
        futures = [sampler.sample([i + 5] * 9, sampling_params=SamplingParams(max_tokens=4, seed=i))
                   for i in range(5)]
        svc.engine.resume()
        assert all(len(f.result().sequences) == 1 for f in futures)
        assert svc.engine_stats()["max_batch_size"] == 5


def test_stop_strings_stop_tokens_and_max_tokens(service: LocalService) -> None:
    sampler = service.create_sampling_client(stop_at_end_of_turn=False)
    prompt = list(range(400, 420))
    free = sampler.sample(prompt, sampling_params=GREEDY).result().sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == GREEDY.max_tokens
    stop_id = free.tokens[4]
    by_id = sampler.sample(
        prompt, sampling_params=GREEDY.model_copy(update={"stop_token_ids": [stop_id]})
    ).result().sequences[0]
    assert by_id.stop_reason == "stop"
    assert by_id.tokens == free.tokens[: free.tokens.index(stop_id) + 1]
    text_of = service.tokenizer.decode
    stop_text = text_of(free.tokens[6:7]) or text_of(free.tokens[5:7])
    by_text = sampler.sample(
        prompt, sampling_params=GREEDY.model_copy(update={"stop": [stop_text]})
    ).result().sequences[0]
    assert by_text.stop_reason == "stop"
    assert stop_text in text_of(by_text.tokens)
    assert stop_text not in text_of(by_text.tokens[:-1])
    assert by_text.tokens == free.tokens[: len(by_text.tokens)]


def test_default_end_of_turn_ids_stop_sampling(service: LocalService) -> None:
    sampler = service.create_sampling_client()
    im_end = service.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in sampler.default_stop_token_ids
    assert service.tokenizer.eos_token_id in sampler.default_stop_token_ids
    assert service.create_sampling_client(stop_at_end_of_turn=False).default_stop_token_ids == ()


@pytest.mark.parametrize(
    ("prompt", "params", "num_samples", "message"),
    [
        ([1, 2, 5000], GREEDY, 1, "token id 5000 at index 2"),
        ([1] * 505, GREEDY, 1, "max_seq_len 512"),
        ([1, 2], GREEDY, 0, "num_samples"),
        ([1, 2], GREEDY.model_copy(update={"stop_token_ids": [99999]}), 1, "stop_token_ids"),
        ([], GREEDY, 1, "tokens"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(
    service: LocalService, prompt: list[int], params: SamplingParams, num_samples: int, message: str
) -> None:
    sampler = service.create_sampling_client()
    with pytest.raises(ValueError, match=message):
        sampler.sample(prompt, num_samples=num_samples, sampling_params=params)
    resp = sampler.sample([1, 2, 3], sampling_params=GREEDY).result()
    assert len(resp.sequences[0].tokens) >= 1


def test_sample_can_be_awaited(service: LocalService) -> None:
    sampler = service.create_sampling_client()

    async def main() -> list[int]:
        responses = await asyncio.gather(
            *(sampler.sample([7, 8, 9], sampling_params=SamplingParams(max_tokens=3, seed=5))
              for _ in range(3))
        )
        return [len({tuple(r.sequences[0].tokens) for r in responses})]

    assert asyncio.run(main()) == [1]


def test_an_error_inside_the_engine_fails_only_its_request(service: LocalService) -> None:
    broken = Transformer(SMALL)

    def explode(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("boom")

    broken.forward = explode  # type: ignore[method-assign]
    future = service.engine.submit([1, 2, 3], broken, 99, GREEDY)
    with pytest.raises(RuntimeError, match="boom"):
        future.result()
    resp = service.create_sampling_client().sample([1, 2, 3], sampling_params=GREEDY).result()
    assert len(resp.sequences[0].tokens) >= 1
    service.check_cache_integrity()


def test_a_failing_forward_fails_its_requests_while_others_keep_running() -> None:
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        broken = Transformer(SMALL)
        calls = {"n": 0}

        def explode_on_second_call(*args: object, **kwargs: object) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] == 2:  # the first decode step, after a good prefill
                raise RuntimeError("boom in decode")
            return Transformer.forward(broken, *args, **kwargs)  # type: ignore[arg-type]

        broken.forward = explode_on_second_call  # type: ignore[method-assign]
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        svc.engine.pause()
        good = sampler.sample(list(range(1, 40)), num_samples=2, sampling_params=GREEDY)
        bad = svc.engine.submit(list(range(1, 40)), broken, 7, GREEDY, num_samples=3)
        svc.engine.resume()
        with pytest.raises(RuntimeError, match="boom in decode"):
            bad.result()
        assert [len(s.tokens) for s in good.result().sequences] == [12, 12]
        svc.check_cache_integrity()  # the failed request's blocks and promises are freed
        assert svc.cache_stats()["reserved_blocks"] == 0
        assert svc.engine_stats()["requests_failed"] == 1


def test_an_engine_bug_fails_every_request_in_flight_and_returns_their_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        scheduler = svc.engine.scheduler
        steps = {"n": 0}
        drop_dead_versions = scheduler._drop_dead_versions  # the first call of every schedule()

        def bug_in_the_second_step() -> None:
            steps["n"] += 1
            if steps["n"] == 2:
                raise RuntimeError("engine bug")
            drop_dead_versions()

        monkeypatch.setattr(scheduler, "_drop_dead_versions", bug_in_the_second_step)
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        svc.engine.pause()
        # admitted together; the prompt-scoring one is prefilled alone, first, and the
        # other waits in the next chunk, its blocks promised but not yet taken
        running = sampler.sample(list(range(1, 30)), sampling_params=GREEDY,
                                 include_prompt_logprobs=True)
        admitted = sampler.sample(list(range(100, 150)), num_samples=3, sampling_params=GREEDY)
        svc.engine.resume()
        for future in (running, admitted):
            with pytest.raises(RuntimeError, match="engine bug"):
                future.result()
        svc.check_cache_integrity()
        assert svc.cache_stats()["reserved_blocks"] == 0
        assert len(sampler.sample([1, 2, 3], sampling_params=GREEDY).result().sequences[0].tokens) == 12


def test_a_bug_in_postprocess_fails_the_prefill_batch_it_was_handling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        scheduler = svc.engine.scheduler
        postprocess, calls = scheduler.postprocess, {"n": 0}

        def bug_in_the_first_postprocess(batch, output):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 1:  # the request's prefill batch
                raise RuntimeError("bug in postprocess")
            postprocess(batch, output)

        monkeypatch.setattr(scheduler, "postprocess", bug_in_the_first_postprocess)
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        future = sampler.sample([1, 2, 3], sampling_params=GREEDY)
        with pytest.raises(RuntimeError, match="bug in postprocess"):
            future.result(timeout=60)
        assert svc.engine_stats()["requests_failed"] == 1
        svc.check_cache_integrity()
        assert svc.cache_stats()["reserved_blocks"] == 0
        assert len(sampler.sample([1, 2, 3], sampling_params=GREEDY).result().sequences[0].tokens) == 12


@pytest.mark.parametrize("where", ["admission", "prefill", "postprocess"])
def test_a_bug_in_a_step_fails_the_request_it_concerns_and_others_run_on(
    monkeypatch: pytest.MonkeyPatch, where: str,
) -> None:
    # one wave of three; the long prompt is its own prefill chunk, after the other two
    short, bad, other = list(range(1, 11)), list(range(200, 300)), list(range(20, 32))
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        scheduler, cache = svc.engine.scheduler, svc.engine.cache
        if where == "admission":  # before the request leaves the waiting queue
            match = cache.match

            def bug_in_match(tokens, version, max_tokens):  # type: ignore[no-untyped-def]
                if list(tokens) == bad:
                    raise RuntimeError("bug in the step")
                return match(tokens, version, max_tokens)

            monkeypatch.setattr(cache, "match", bug_in_match)
        elif where == "prefill":  # after its chunk left the queue and took its blocks
            prefill_batch = scheduler._prefill_batch

            def bug_in_prefill(reqs):  # type: ignore[no-untyped-def]
                batch = prefill_batch(reqs)
                if reqs[0].prompt == bad:
                    raise RuntimeError("bug in the step")
                return batch

            monkeypatch.setattr(scheduler, "_prefill_batch", bug_in_prefill)
        else:  # its prefill ran; the others' prefill did too
            postprocess = scheduler.postprocess

            def bug_in_postprocess(batch, output):  # type: ignore[no-untyped-def]
                if batch.requests and batch.requests[0].prompt == bad:
                    raise RuntimeError("bug in the step")
                postprocess(batch, output)

            monkeypatch.setattr(scheduler, "postprocess", bug_in_postprocess)
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        svc.engine.pause()
        futures = [sampler.sample(p, sampling_params=GREEDY) for p in (short, bad, other)]
        svc.engine.resume()
        for i in (0, 2):
            assert len(futures[i].result(timeout=60).sequences[0].tokens) == 12
        with pytest.raises(RuntimeError, match="bug in the step"):
            futures[1].result(timeout=60)
        assert svc.engine_stats()["requests_failed"] == 1
        svc.check_cache_integrity()
        stats = svc.cache_stats()
        assert stats["reserved_blocks"] == stats["referenced_blocks"] == 0


@pytest.mark.parametrize("joined", [False, True], ids=["own prompt", "joined"])
def test_a_failing_stop_check_fails_only_its_request(joined: bool) -> None:
    """Also when the failing request joined the other's prefill (the same prompt): after
    the prefill, each goes its own way."""
    from prefixgym.engine.service import EngineService

    def decode(ids: list[int]) -> str:
        raise UnicodeError("cannot decode")

    with EngineService(SMALL, seed=0, decode=decode) as engine:
        sampler = engine.create_sampling_client()
        params = SamplingParams(max_tokens=6, temperature=0.0)
        futures = sampler.sample_many([
            SampleRequest([1, 2, 3] if joined else [4, 5, 6], 2, params),
            SampleRequest([1, 2, 3], 1, params.model_copy(update={"stop": ["x"]}))])
        with pytest.raises(UnicodeError, match="cannot decode"):
            futures[1].result()
        assert [len(s.tokens) for s in futures[0].result().sequences] == [6, 6]
        assert engine.engine_stats()["joined_requests"] == int(joined)
        engine.check_cache_integrity()


def test_sample_many_enters_one_step_so_batches_do_not_depend_on_timing() -> None:
    prompts = [[i + 5] * (9 + i) for i in range(5)]
    params = [SamplingParams(max_tokens=4, seed=i) for i in range(5)]
    runs = []
    for _ in range(2):
        with LocalService(SMALL, seed=0, thread_tuning=False) as svc:
            sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
            futures = sampler.sample_many([SampleRequest(p, 1, q) for p, q in zip(prompts, params)])
            tokens = [f.result().sequences[0].tokens for f in futures]
            stats = svc.engine_stats()
            assert (stats["prefill_calls"], stats["max_batch_size"]) == (1, 5)
            runs.append((tokens, stats))
    assert runs[0] == runs[1]
    with LocalService(SMALL, seed=0) as svc, pytest.raises(ValueError, match="token id"):
        svc.create_sampling_client().sample_many([SampleRequest([1, 2]), SampleRequest([1, 99999])])
