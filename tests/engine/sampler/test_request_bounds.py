"""Requests are bounded before anything is allocated: samples per request by the
engine's max running sequences, a request's running KV by a byte budget; running
sequences never exceed max_running; refused requests leave the engine serving."""

from __future__ import annotations

import pytest

from prefixgym.engine.model import ModelConfig
from prefixgym.engine.sampler.requests import kv_bytes_per_position
from prefixgym.engine.service import EngineService
from prefixgym.types import SamplingParams

SMALL = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    hidden_dim=64, max_seq_len=256)
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, seed=0)


def test_samples_beyond_max_running_are_refused_at_submit() -> None:
    with EngineService(SMALL, max_running=8, thread_tuning=False) as svc:
        sampler = svc.create_sampling_client()
        for n in (9, 10_000):
            with pytest.raises(ValueError, match=f"num_samples {n} exceeds this engine's limit "
                                                 "of 8 sequences"):
                sampler.sample([1, 2, 3], num_samples=n, sampling_params=PARAMS)
        stats = svc.cache_stats()  # no KV block was taken or promised
        assert stats["running_blocks"] == stats["reserved_blocks"] == stats["num_blocks"] == 0
        assert len(sampler.sample([1, 2, 3], num_samples=8,
                                  sampling_params=PARAMS).result().sequences) == 8


def test_running_sequences_never_exceed_max_running() -> None:
    with EngineService(SMALL, max_running=8, thread_tuning=False) as svc:
        sampler = svc.create_sampling_client()
        svc.engine.pause()
        futures = [sampler.sample([i + 1] * 5, num_samples=n, sampling_params=PARAMS)
                   for i, n in enumerate((8, 5, 3, 8))]
        svc.engine.resume()
        assert [len(f.result().sequences) for f in futures] == [8, 5, 3, 8]
        assert svc.engine_stats()["max_batch_size"] <= 8


def test_a_request_whose_kv_cannot_fit_is_refused() -> None:
    with EngineService(SMALL, thread_tuning=False) as svc:
        per_position = kv_bytes_per_position(svc.train_model)
    assert per_position == 2 * 2 * 2 * 8 * 4  # fp32 K and V, 2 layers x 2 heads x 8 dims
    budget = 4 * 50 * per_position  # four samples of 50 positions
    with EngineService(SMALL, max_kv_bytes=budget, thread_tuning=False) as svc:
        sampler = svc.create_sampling_client()
        fits = SamplingParams(max_tokens=40, seed=0)
        assert len(sampler.sample([1] * 10, num_samples=4, sampling_params=fits)
                   .result().sequences) == 4
        with pytest.raises(ValueError, match=r"5 samples x 50 positions need .* MiB of KV, more "
                                             r"than this engine's .* MiB per request"):
            sampler.sample([1] * 10, num_samples=5, sampling_params=fits)
        with pytest.raises(ValueError, match="4 samples x 51 positions"):
            sampler.sample([1] * 11, num_samples=4, sampling_params=fits)
        svc.check_cache_integrity()
