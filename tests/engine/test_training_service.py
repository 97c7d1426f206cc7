"""The train phase against the sampling engine: same logprobs, new weights never
read old KV."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from numerics import max_abs_logit

from prefixgym.engine.model import ModelConfig
from prefixgym.local_service import LocalService
from prefixgym.types import AdamParams, Datum, ModelInput, SamplingParams

CONFIG = ModelConfig(
    vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=256
)
PROMPT = [(17 * i + 5) % 4000 + 10 for i in range(40)]  # 2.5 cache blocks of 16


@pytest.fixture
def service() -> Iterator[LocalService]:
    with LocalService(model=CONFIG, seed=0, block_size=16) as svc:
        yield svc


def _datum(prompt: list[int], completion: list[int], sampler_logprobs: list[float]) -> Datum:
    tokens = prompt + completion
    n_prompt = len(prompt) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [0.0] * n_prompt + [1.0] * len(completion),
            "logprobs": [0.0] * n_prompt + sampler_logprobs,
            "advantages": [0.0] * n_prompt + [1.0] * len(completion),
        },
    )


def _sample(sampler, seed: int = 0):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
    return sampler.sample(ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params)


def test_sampler_and_trainer_logprobs_agree_before_and_after_a_step(service: LocalService,
                                                                    numerics) -> None:
    """On-policy, the trainer's logprobs are the sampler's up to the trainer's rounding
    (fp32: summation order; bf16: tests/numerics.py), and the importance weights are
    exactly exp(trainer - sampler) of those numbers: the loss of advantage 1 is minus
    their sum, computed from the fp32 logprobs, not from anything rounded to bf16."""
    trainer = service.create_training_client(compute_dtype=numerics.dtype)
    sampler = service.create_sampling_client(stop_at_end_of_turn=False)
    for _ in range(2):  # initial weights, then the weights after one update
        response = _sample(sampler).result()
        datums = [_datum(PROMPT, s.tokens, s.logprobs) for s in response.sequences]
        out = trainer.forward_backward(datums, "importance_sampling").result()
        scale = max(max_abs_logit(service.train_model, PROMPT + s.tokens)
                    for s in response.sequences)
        atol = numerics.logprob_atol(1e-4, CONFIG.n_layers, scale)
        ratios = []
        for seq, lp in zip(response.sequences, out.loss_fn_outputs):
            trained = lp["logprobs"][len(PROMPT) - 1 :]
            assert trained == pytest.approx(seq.logprobs, abs=atol)
            ratios += [math.exp(t - s) for t, s in zip(trained, seq.logprobs)]
        assert out.metrics["loss:sum"] == pytest.approx(-sum(ratios), rel=1e-5)
        assert out.metrics["ratio/mean"] == pytest.approx(1.0, abs=math.expm1(atol))
        trainer.optim_step(AdamParams(learning_rate=1e-2)).result()
        sampler = trainer.save_weights_and_get_sampling_client()
    assert service.weights_version == 2


def test_published_weights_never_hit_kv_cached_under_old_weights(service: LocalService) -> None:
    old = service.create_sampling_client()
    _sample(old).result()
    again = _sample(old, seed=1).result()
    assert again.usage.prefill_cached_tokens > 0  # the cache works under one version

    trainer = service.create_training_client()
    datum = Datum(
        model_input=ModelInput.from_ints(PROMPT[:-1]), loss_fn_inputs={"target_tokens": PROMPT[1:]}
    )
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(AdamParams(learning_rate=1e-3)).result()
    new = trainer.save_weights_and_get_sampling_client()
    hits_before = service.cache_stats()["hit_tokens"]
    fresh = _sample(new).result()
    assert fresh.usage.prefill_cached_tokens == 0
    assert fresh.usage.prefill_computed_tokens == len(PROMPT)
    assert service.cache_stats()["hit_tokens"] == hits_before
    assert service.usage().train_computed_tokens == len(PROMPT) - 1
    service.check_cache_integrity()


def test_training_clients_share_prefixes_unless_told_not_to(service: LocalService) -> None:
    response = _sample(service.create_sampling_client(stop_at_end_of_turn=False)).result()
    datums = [_datum(PROMPT, s.tokens, s.logprobs) for s in response.sequences]
    inputs = [d.model_input.tokens for d in datums]
    distinct = len({tuple(t[: k + 1]) for t in inputs for k in range(len(t))})
    before = service.usage()
    shared = service.create_training_client().forward(datums, "importance_sampling").result()
    plain = service.create_training_client(share_prefixes=False).forward(
        datums, "importance_sampling").result()
    assert shared.usage.train_computed_tokens == distinct <= sum(map(len, inputs)) - len(PROMPT)
    assert plain.usage.train_computed_tokens == shared.usage.train_tokens == sum(map(len, inputs))
    for a, b in zip(shared.loss_fn_outputs, plain.loss_fn_outputs):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    spent = service.usage() - before
    assert spent.train_shared_tokens == shared.usage.train_shared_tokens > 0
    assert spent.train_tokens == 2 * sum(map(len, inputs))
