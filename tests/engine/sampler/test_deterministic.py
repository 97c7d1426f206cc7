"""Deterministic mode: `sample_many` rounds are queued atomically and run alone, so a
round's logprobs are the same bits whatever else is submitted around it."""

from __future__ import annotations

import pytest

from prefixgym.engine.model import ModelConfig
from prefixgym.local_service import LocalService
from prefixgym.types import SampleRequest, SamplingParams

SMALL = ModelConfig(vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    hidden_dim=128, max_seq_len=512)


def round_of(n: int, base: int, max_tokens: int = 6) -> list[SampleRequest]:
    return [SampleRequest([base + i] * (7 + 3 * i), 1 + i % 2,
                          SamplingParams(max_tokens=max_tokens, seed=base + i))
            for i in range(n)]


def outputs(futures: list) -> list[tuple[list[int], list[float]]]:
    return [(s.tokens, s.logprobs) for f in futures for s in f.result().sequences]


def test_a_round_runs_alone_and_gives_the_same_bits_beside_other_rounds() -> None:
    mine = round_of(3, 100)
    with LocalService(SMALL, seed=0, deterministic=True) as svc:
        alone = outputs(svc.create_sampling_client().sample_many(mine))
    with LocalService(SMALL, seed=0, deterministic=True) as svc:
        sampler = svc.create_sampling_client()
        svc.engine.pause()  # both rounds are queued before the engine looks
        ours = sampler.sample_many(mine)
        theirs = sampler.sample_many(round_of(5, 200, max_tokens=12))
        single = sampler.sample([9] * 11, sampling_params=SamplingParams(max_tokens=4, seed=1))
        svc.engine.resume()
        beside = outputs(ours)
        outputs(theirs), single.result()
        # never more rows than the largest round (5 requests, 7 samples) in one batch
        assert svc.engine_stats()["max_batch_size"] == 7
    assert beside == alone


def test_free_running_batches_rounds_together() -> None:
    with LocalService(SMALL, seed=0) as svc:
        sampler = svc.create_sampling_client()
        svc.engine.pause()
        futures = [*sampler.sample_many(round_of(3, 100)), *sampler.sample_many(round_of(5, 200))]
        svc.engine.resume()
        outputs(futures)
        assert svc.engine_stats()["max_batch_size"] == 4 + 7


def test_a_bad_request_refuses_the_whole_round_and_queues_nothing() -> None:
    with LocalService(SMALL, seed=0, deterministic=True) as svc:
        sampler = svc.create_sampling_client()
        bad = [*round_of(2, 100), SampleRequest([5, 4096], 1, SamplingParams(max_tokens=2))]
        with pytest.raises(ValueError, match=r"^request 2: prompt token id 4096"):
            sampler.sample_many(bad)
        assert sampler.sample_many([]) == []
        good = outputs(sampler.sample_many(round_of(2, 100)))
        assert len(good) == 3
        assert svc.engine_stats()["requests_completed"] == 2


@pytest.mark.parametrize("deterministic", [True, False])
def test_closing_fails_the_round_that_runs_and_those_queued(deterministic: bool) -> None:
    svc = LocalService(SMALL, seed=0, deterministic=deterministic)
    sampler = svc.create_sampling_client()
    svc.engine.pause()
    first = sampler.sample_many(round_of(2, 100, max_tokens=200))
    second = sampler.sample_many(round_of(2, 300))
    svc.close()
    for future in [*first, *second]:
        with pytest.raises(RuntimeError, match="closed"):
            future.result()
