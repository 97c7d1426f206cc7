"""LocalService: construction, versions, clients, stats, closing."""

from __future__ import annotations

import gc
import weakref

import pytest

from prefixgym.engine import malloc_tuning
from prefixgym.engine.model import ModelConfig, Transformer
from prefixgym.engine.model.packed import packed_layers
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.local_service import LocalService
from prefixgym.types import AdamParams, Datum, ModelInput, SamplingParams

SMALL = ModelConfig(vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    hidden_dim=128, max_seq_len=512)


def test_tiny_preset_with_builtin_tokenizer() -> None:
    with LocalService("tiny", seed=0) as svc:
        assert len(svc.tokenizer) == 4096
        assert isinstance(svc.train_model, Transformer) and svc.weights_version == 0
        ids = svc.tokenizer.encode("hello world")
        resp = svc.create_sampling_client().sample(
            ids, sampling_params=SamplingParams(max_tokens=3, seed=0)).result()
        assert len(resp.sequences[0].tokens) <= 3


def test_training_then_publishing_changes_the_sampler() -> None:
    with LocalService(SMALL, seed=0) as svc:
        prompt = list(range(30, 50))
        greedy = SamplingParams(max_tokens=4, temperature=0.0)
        before = svc.create_sampling_client().sample(prompt, sampling_params=greedy).result()
        trainer = svc.create_training_client()
        assert isinstance(trainer, TrainingClient)
        target = before.sequences[0].tokens[0]
        tokens = prompt + [(target + 1) % 4096]
        datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"target_tokens": tokens[1:],
                                      "weights": [0.0] * (len(prompt) - 1) + [1.0]})
        for _ in range(5):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
        new = trainer.save_weights_and_get_sampling_client()
        assert new.weights_version == svc.weights_version == 1
        after = new.sample(prompt, sampling_params=greedy).result()
        assert after.sequences[0].tokens[0] == (target + 1) % 4096
        assert after.usage.prefill_cached_tokens == 0  # old KV never serves new weights
        assert svc.usage().train_computed_tokens == 5 * len(tokens[:-1])


def test_each_phase_times_its_own_work() -> None:
    """The engine adds each forward's seconds to its kind, the trainer each call's."""
    with LocalService(SMALL, seed=0) as svc:
        zero = svc.seconds()
        assert zero == dict.fromkeys(
            ("prefill", "decode", "forward_backward", "optim_step", "publish"), 0.0)
        svc.create_sampling_client().sample(list(range(30, 50)), sampling_params=SamplingParams(
            max_tokens=1, seed=0)).result()
        one_token = svc.seconds()  # one prefill samples the first token: no decode step
        assert one_token["prefill"] > 0 and one_token["decode"] == 0
        svc.create_sampling_client().sample(list(range(60, 80)), sampling_params=SamplingParams(
            max_tokens=4, seed=0)).result()
        assert svc.seconds()["decode"] > 0
        trainer = svc.create_training_client()
        datum = Datum(model_input=ModelInput.from_ints(list(range(30, 49))),
                      loss_fn_inputs={"target_tokens": list(range(31, 50))})
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(AdamParams(learning_rate=1e-3)).result()
        trainer.save_weights_and_get_sampling_client()
        after = svc.seconds()
        assert all(after[p] > 0 for p in ("forward_backward", "optim_step", "publish"))


def test_cache_stats_and_disabled_cache() -> None:
    with LocalService(SMALL, block_size=8, cache_bytes=2**20) as svc:
        svc.create_sampling_client().sample(list(range(1, 30)),
                                            sampling_params=SamplingParams(max_tokens=2)).result()
        stats = svc.cache_stats()
        assert stats["block_size"] == 8 and stats["capacity_bytes"] == 2**20
        assert stats["num_blocks"] >= 3 and stats["used_bytes"] > 0
        assert stats["query_tokens"] == 29
    with LocalService(SMALL, prefix_cache=False) as svc:
        resp = svc.create_sampling_client().sample(
            list(range(1, 40)), sampling_params=SamplingParams(max_tokens=2)).result()
        resp2 = svc.create_sampling_client().sample(
            list(range(1, 40)), sampling_params=SamplingParams(max_tokens=2)).result()
        assert resp2.usage.prefill_cached_tokens == 0 == resp.usage.prefill_cached_tokens
        assert svc.cache_stats()["used_bytes"] == 0 and svc.cache_stats()["enabled"] == 0


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="dtype"):
        LocalService(SMALL, dtype="int8")
    with pytest.raises(ValueError, match="unknown model"):
        LocalService("no-such-model")
    with pytest.raises(ValueError, match="model must be"):
        LocalService(3)  # type: ignore[arg-type]


def test_close_stops_the_engine_thread() -> None:
    svc = LocalService(SMALL)
    sampler = svc.create_sampling_client()
    svc.close()
    assert not svc.engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        sampler.sample([1, 2, 3])
    svc.close()  # idempotent


def test_the_engine_alone_knows_ids_only() -> None:
    """EngineService has no tokenizer: it stops at the end-of-turn ids it is given and
    refuses stop strings unless it was given a decode."""
    from prefixgym.engine.service import EngineService

    with EngineService(SMALL, seed=0) as engine:
        assert not hasattr(engine, "tokenizer")
        free = engine.create_sampling_client().sample(
            list(range(30, 40)), sampling_params=SamplingParams(max_tokens=6, temperature=0.0)
        ).result().sequences[0]
        with pytest.raises(ValueError, match="stop strings"):
            engine.create_sampling_client().sample(
                [1, 2], sampling_params=SamplingParams(max_tokens=2, stop=["x"])).result()
    stop_at = free.tokens[2]
    with EngineService(SMALL, seed=0, end_of_turn_ids=[stop_at, 10**6]) as engine:
        sampler = engine.create_sampling_client()
        assert sampler.default_stop_token_ids == (stop_at,)  # ids past the vocabulary dropped
        cut = sampler.sample(list(range(30, 40)), sampling_params=SamplingParams(
            max_tokens=6, temperature=0.0)).result().sequences[0]
        assert cut.tokens == free.tokens[: free.tokens.index(stop_at) + 1]
        assert cut.stop_reason == "stop"


def test_a_version_that_sampled_is_freed_without_the_collector() -> None:
    """A finished request lets go of its samples (which point back at it), so a version
    that sampled and that no client holds goes when its last reference does, with no
    collection (a publish runs none)."""
    gc.disable()
    try:
        with LocalService("tiny", seed=0) as svc:
            trainer = svc.create_training_client()
            versions = []
            for seed in range(3):
                sampler = trainer.save_weights_and_get_sampling_client()
                versions.append(weakref.ref(sampler._model))
                sampler.sample([1, 2, 3, 4, 5], num_samples=2,
                               sampling_params=SamplingParams(max_tokens=4, seed=seed)).result()
                del sampler
            assert [v() is None for v in versions] == [True, True, False]  # the newest stays
    finally:
        gc.enable()


def test_a_publish_lets_the_previous_version_go_and_trims_malloc(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An older version that no client holds is freed with its packed weights, no
    collection needed, and every publish hands malloc's free bytes back
    (`malloc_tuning.release_free_memory_later`): the memory of a long run stays flat."""
    trims: list[int] = []
    monkeypatch.setattr(malloc_tuning, "release_free_memory_later",
                        lambda: trims.append(1) or None)
    gc.disable()  # nothing collects
    try:
        with LocalService(SMALL, seed=0) as svc:
            trainer = svc.create_training_client()
            first = trainer.save_weights_and_get_sampling_client()
            gone = weakref.ref(first._model)
            layers = [weakref.ref(layer) for layer in packed_layers(first._model)]
            second = trainer.save_weights_and_get_sampling_client()
            assert gone() is not None  # a client still holds version 1
            del first
            trainer.save_weights_and_get_sampling_client()
            assert gone() is None and all(layer() is None for layer in layers)
            assert second.weights_version == 2 and trims == [1, 1, 1]
            svc.create_lora_training_client(rank=4).save_weights_and_get_sampling_client()
            assert trims == [1, 1, 1, 1]
    finally:
        gc.enable()
