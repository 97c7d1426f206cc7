"""Token selection (greedy, temperature, top-k, top-p) and the SamplingClient's contract."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from numerics import max_abs_logit

from prefixgym.engine.model import ModelConfig
from prefixgym.engine.sampler.token_sampler import RowParams, sample_tokens
from prefixgym.local_service import LocalService
from prefixgym.types import Datum, ModelInput, SamplingParams

SMALL = ModelConfig(vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    hidden_dim=128, max_seq_len=512)
LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))


def draw(u: float, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> tuple[int, float]:
    tokens, logprobs = sample_tokens(LOGITS, RowParams.build([temperature], [top_k], [top_p]), [u])
    return int(tokens[0]), float(logprobs[0])


def test_inverse_cdf_draws_follow_the_distribution() -> None:
    assert [draw(u)[0] for u in (0.0, 0.49, 0.51, 0.74, 0.76, 0.9, 0.99)] == [0, 0, 1, 1, 2, 3, 3]


def test_greedy_top_k_and_top_p_filters() -> None:
    assert draw(0.99, temperature=0.0)[0] == 0
    assert draw(0.99, top_k=1)[0] == 0
    assert [draw(u, top_k=2)[0] for u in (0.6, 0.7)] == [0, 1]  # renormalised to 2/3, 1/3
    assert draw(0.99, top_p=0.5)[0] == 0  # the first token alone holds half the mass
    assert [draw(u, top_p=0.7)[0] for u in (0.6, 0.7)] == [0, 1]


def test_logprobs_are_unfiltered_temperature_one() -> None:
    token, logprob = draw(0.99, temperature=0.3, top_k=2)
    assert token == 1
    assert logprob == pytest.approx(math.log(0.25), abs=1e-6)


def test_rows_are_independent_of_their_batch_mates() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = RowParams.build([1.0, 0.0, 0.7], [-1, -1, 5], [1.0, 1.0, 0.8])
    batched, _ = sample_tokens(logits, params, [0.3, 0.0, 0.6])
    for row, u in enumerate([0.3, 0.0, 0.6]):
        alone = RowParams.build([params.temperature_B[row].item()], [int(params.top_k_B[row])],
                                [params.top_p_B[row].item()])
        single, _ = sample_tokens(logits[row : row + 1], alone, [u])
        assert int(single[0]) == int(batched[row])


@pytest.fixture(scope="module")
def service() -> Iterator[LocalService]:
    with LocalService(SMALL, seed=0) as svc:
        yield svc


def test_sampled_logprobs_match_the_trainers_forward(service: LocalService, numerics) -> None:
    sampler = service.create_sampling_client(stop_at_end_of_turn=False)
    prompt = list(range(20, 60))
    seq = sampler.sample(ModelInput.from_ints(prompt),
                         sampling_params=SamplingParams(max_tokens=10, temperature=0.8, top_k=20,
                                                        seed=3)).result().sequences[0]
    tokens = prompt + seq.tokens
    datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                  loss_fn_inputs={"target_tokens": tokens[1:]})
    trainer = service.create_training_client(compute_dtype=numerics.dtype)
    out = trainer.forward([datum], loss_fn="cross_entropy").result()
    trained = out.loss_fn_outputs[0]["logprobs"][len(prompt) - 1 :]
    atol = numerics.logprob_atol(1e-4, SMALL.n_layers, max_abs_logit(service.train_model, tokens))
    assert trained == pytest.approx(seq.logprobs, abs=atol)


def test_usage_is_recorded_for_every_response(service: LocalService) -> None:
    sampler = service.create_sampling_client(stop_at_end_of_turn=False)
    before = service.usage()
    a = sampler.sample([5] * 20, num_samples=3, sampling_params=SamplingParams(max_tokens=4)).result()
    b = sampler.compute_logprobs([6] * 10).result()
    after = service.usage()
    assert len(b) == 10 and b[0] is None
    assert a.usage.sampled_tokens == 12
    assert after.sampled_tokens - before.sampled_tokens == 12
    assert after.prefill_tokens - before.prefill_tokens == 20 + 10
    assert after.prefill_computed_tokens - before.prefill_computed_tokens >= 10


def test_max_tokens_zero_returns_empty_sequences(service: LocalService) -> None:
    resp = service.create_sampling_client().sample(
        [1, 2, 3], num_samples=2, sampling_params=SamplingParams(max_tokens=0)).result()
    assert [(s.tokens, s.stop_reason) for s in resp.sequences] == [([], "length")] * 2


def test_prompt_must_be_token_ids(service: LocalService) -> None:
    sampler = service.create_sampling_client()
    with pytest.raises(ValueError, match="prompt must be"):
        sampler.sample("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        sampler.sample([3, -1])


# -- the hosted service's fields and parameters -------------------------------------------


def test_sequence_ids_are_unique_and_cache_hits_are_reported() -> None:
    with LocalService(SMALL, seed=0, block_size=16) as svc:
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        prompt = list(range(100, 150))  # 50 tokens: 3 full blocks and 2 more
        params = SamplingParams(max_tokens=2, seed=1)
        first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        second = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        ids = [s.sequence_id for r in (first, second) for s in r.sequences]
        assert len(set(ids)) == 5 and all(isinstance(i, str) and i for i in ids)
        assert first.prompt_cache_hit_tokens == first.usage.prefill_cached_tokens == 0
        # the first request's finished samples left their partial 4th block (the prompt's
        # last 2 tokens, a sampled one) in the cache: all but the last prompt token hit
        assert second.prompt_cache_hit_tokens == second.usage.prefill_cached_tokens == 49


def test_prompt_logprobs_last_n_reads_the_prefix_from_the_cache() -> None:
    with LocalService(SMALL, seed=0, block_size=16) as svc:
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        prompt = list(range(200, 250))  # 50 tokens
        full = sampler.compute_logprobs(prompt).result()  # scores all; fills the cache
        resp = sampler.sample(prompt, sampling_params=SamplingParams(max_tokens=0),
                              include_prompt_logprobs=True, topk_prompt_logprobs=3,
                              prompt_logprobs_last_n=10).result()
        # 50 tokens are cached (3 blocks and a partial one); the positions before the first
        # scored one's logits, 50 - 10 - 1 = 39, hit: 2 blocks and 7 tokens of the third
        assert resp.prompt_cache_hit_tokens == 39
        assert resp.usage.prefill_computed_tokens == 11
        lp = resp.prompt_logprobs
        assert lp is not None and lp[:40] == [None] * 40
        assert lp[40:] == pytest.approx(full[40:], abs=1e-5)
        top = resp.topk_prompt_logprobs
        assert top is not None and top[:40] == [None] * 40 and len(top) == 50
        for i in range(40, 50):
            ids, values = zip(*top[i], strict=True)
            assert len(ids) == 3 and list(values) == sorted(values, reverse=True)
            # the prompt token's own logprob is at most the best one
            assert values[0] >= lp[i] - 1e-6
        whole = sampler.sample(prompt, sampling_params=SamplingParams(max_tokens=0),
                               topk_prompt_logprobs=1).result()
        assert whole.prompt_logprobs is None  # only the top-k were asked for
        assert whole.prompt_cache_hit_tokens == 0
        assert whole.topk_prompt_logprobs is not None and whole.topk_prompt_logprobs[0] is None
        svc.check_cache_integrity()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prompt_logprobs_last_n": 3}, "needs include_prompt_logprobs"),
    ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": 0}, r"\[1, len\(prompt\)"),
    ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": 5}, r"\[1, len\(prompt\)"),
    ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
])
def test_bad_prompt_scoring_requests_are_refused(service: LocalService, kwargs: dict,
                                                 match: str) -> None:
    with pytest.raises(ValueError, match=match):
        service.create_sampling_client().sample([1, 2, 3, 4, 5], **kwargs)
