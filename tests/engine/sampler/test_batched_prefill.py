"""Batched prefill and weights-version retirement in the engine and its prefix cache."""

from __future__ import annotations

import gc

import pytest
import torch

from prefixgym.engine.model import ModelConfig, Transformer
from prefixgym.engine.sampler.kv_pool import KVPool
from prefixgym.local_service import LocalService
from prefixgym.types import SampleResponse, SamplingParams

SMALL = ModelConfig(vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    hidden_dim=128, max_seq_len=512)
BS = 16
SYSTEM = list(range(1000, 1040))  # 40 tokens: two full blocks and a partial one


def workload() -> list[tuple[list[int], int, SamplingParams]]:
    """Requests of mixed lengths, shared prefixes, sample counts and sampling settings."""
    out = []
    for i in range(7):
        tail = [(i * 37 + j) % 4000 + 1 for j in range(3 + 5 * i)]
        params = SamplingParams(max_tokens=6 + i, temperature=0.0 if i % 2 else 1.0,
                                top_k=20 if i == 2 else -1, seed=100 + i)
        out.append((SYSTEM + tail, 1 + (i % 3), params))
    out.append(([5, 6, 7], 2, SamplingParams(max_tokens=4, seed=9)))
    return out


def run(svc: LocalService, batched: bool) -> list[SampleResponse]:
    sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
    # warm the cache with a prompt the others extend, so cached starts differ per row
    sampler.sample(SYSTEM + [1], sampling_params=SamplingParams(max_tokens=1, seed=0)).result()
    if not batched:
        return [sampler.sample(p, num_samples=n, sampling_params=sp).result()
                for p, n, sp in workload()]
    svc.engine.pause()
    futures = [sampler.sample(p, num_samples=n, sampling_params=sp) for p, n, sp in workload()]
    svc.engine.resume()
    return [f.result() for f in futures]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_batched_prefill_matches_one_request_at_a_time(prefix_cache: bool) -> None:
    with LocalService(SMALL, seed=0, block_size=BS, prefix_cache=prefix_cache) as alone, \
            LocalService(SMALL, seed=0, block_size=BS, prefix_cache=prefix_cache) as together:
        expected = run(alone, batched=False)
        calls_before = together.engine_stats()["prefill_calls"]
        got = run(together, batched=True)
        assert together.engine_stats()["prefill_calls"] - calls_before < len(workload())
        for (prompt, n, _), a, b in zip(workload(), expected, got):
            assert len(b.sequences) == n
            for sa, sb in zip(a.sequences, b.sequences):
                assert sb.tokens == sa.tokens
                assert sb.logprobs == pytest.approx(sa.logprobs, abs=1e-5)
            assert b.usage.prefill_computed_tokens + b.usage.prefill_cached_tokens == len(prompt)
            assert b.usage.sampled_tokens == sum(len(s.tokens) for s in b.sequences)
        usage = together.usage()
        assert usage.prefill_computed_tokens == together.engine_stats()["prefill_positions"]
        assert usage.prefill_computed_tokens + usage.prefill_cached_tokens == (
            41 + sum(len(p) for p, _, _ in workload()))
        together.check_cache_integrity()


def test_a_wave_computes_a_shared_uncached_prefix_once() -> None:
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        sampler = svc.create_sampling_client(stop_at_end_of_turn=False)
        shared = list(range(2000, 2048))  # three full blocks, nothing cached yet
        prompts = [shared + [i + 1] * (4 + i) for i in range(5)]
        svc.engine.pause()
        futures = [sampler.sample(p, sampling_params=SamplingParams(max_tokens=3, seed=i))
                   for i, p in enumerate(prompts)]
        svc.engine.resume()
        usages = [f.result().usage for f in futures]
        assert sum(u.prefill_computed_tokens for u in usages) == 48 + sum(4 + i for i in range(5))
        assert [u.prefill_cached_tokens for u in usages].count(48) == 4
        svc.check_cache_integrity()


def test_prompt_logprobs_next_to_batched_requests() -> None:
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        sampler = svc.create_sampling_client()
        prompt = list(range(300, 337))
        expected = sampler.compute_logprobs(prompt).result()
        svc.engine.pause()
        others = [sampler.sample(prompt[:20 + i], sampling_params=SamplingParams(max_tokens=2))
                  for i in range(3)]
        mine = sampler.compute_logprobs(prompt)
        svc.engine.resume()
        assert mine.result() == pytest.approx(expected, abs=1e-5)
        assert all(len(f.result().sequences) == 1 for f in others)


def test_old_version_frees_its_blocks() -> None:
    with LocalService(SMALL, seed=0, block_size=BS) as svc:
        prompt = list(range(200, 260))
        params = SamplingParams(max_tokens=4, temperature=0.0)
        old = svc.create_sampling_client()
        old.sample(prompt, sampling_params=params).result()
        old_blocks = svc.cache_stats()["num_blocks"]
        assert old_blocks >= 3
        new = svc.publish_weights()
        new.sample(prompt, sampling_params=params).result()
        assert not svc.engine.scheduler.running.get(0)  # version 0 runs nothing
        assert svc.cache_stats()["num_blocks"] == 2 * old_blocks  # old client still alive
        del old
        gc.collect()
        new.sample([1, 2, 3], sampling_params=params).result()
        new.sample([1, 2, 3], sampling_params=params).result()  # one more loop turn
        # only version 1's blocks left: the prompt's, and [1, 2, 3]'s partial block (greedy: once)
        assert svc.cache_stats()["num_blocks"] == old_blocks + 1
        assert new.sample(prompt, sampling_params=params).result().usage.prefill_cached_tokens == 59
        svc.check_cache_integrity()


def test_bfloat16_sampler_runs_end_to_end_close_to_float32() -> None:
    prompt = list(range(500, 560))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=4)
    with LocalService(SMALL, seed=0, block_size=BS, dtype="bfloat16") as bf16, \
            LocalService(SMALL, seed=0, block_size=BS) as fp32:
        sampler = bf16.create_sampling_client(stop_at_end_of_turn=False)
        first = sampler.sample(prompt, sampling_params=params).result()
        again = sampler.sample(prompt, sampling_params=params).result()
        assert again.usage.prefill_cached_tokens == 59
        assert again.sequences[0].tokens == first.sequences[0].tokens
        seq = first.sequences[0]
        reference = fp32.create_sampling_client().compute_logprobs(prompt + seq.tokens).result()
        assert seq.logprobs == pytest.approx(reference[len(prompt):], abs=0.05)
        bf16.check_cache_integrity()


def test_a_padded_prefill_runs_its_layers_on_its_real_tokens_only() -> None:
    """The view's `Packing`: the linears see the rows' real tokens (no padding), and each
    row's logits are those of the row run alone."""
    model = Transformer(SMALL).eval()
    pool = KVPool(SMALL.n_layers, SMALL.n_kv_heads, SMALL.head_dim, 8, BS, torch.float32,
                  torch.device("cpu"))
    rows = [[11, 12, 13], list(range(20, 27)), [30]]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    view = pool.view([[1], [2], [3]], [0, 0, 0], list(map(len, rows)), width)
    assert view.packing is not None and view.packing.index_M.numel() == 11
    seen: list[int] = []
    hook = model.layers[0].attn.wqkv.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].shape[-2]))
    with torch.inference_mode():
        logits = model(tokens, view.positions_R_T, kv=view)
        last = model(tokens, view.positions_R_T, kv=pool.view([[4], [5], [6]], [0, 0, 0],
                     list(map(len, rows)), width), last_only=True, last_index_B=view.last_index_R)
        hook.remove()
        for r, row in enumerate(rows):
            alone = model(torch.tensor([row]))[0]
            torch.testing.assert_close(logits[r, : len(row)], alone, atol=1e-5, rtol=0)
            torch.testing.assert_close(last[r, 0], alone[-1], atol=1e-5, rtol=0)
    assert seen == [11, 11]  # (1, M) tokens: the padding never reached a linear
    full = pool.view([[1]], [0], [3], 3)
    assert full.packing is None  # nothing to skip: the plain (B, T) forward
