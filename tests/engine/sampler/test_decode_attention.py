"""Forwards through the paged KV pool: fp32 and bf16 blocks for a bf16 model, rows at
their own positions in scattered blocks, cached and uncached the same."""

from __future__ import annotations

import torch

from prefixgym.engine.model import load_model
from prefixgym.engine.sampler.kv_pool import DecodeView, DecodeWorkspace, KVPool
from prefixgym.local_service import LocalService
from prefixgym.types import ModelInput, SamplingParams

BS = 4


def _pool(model: torch.nn.Module, kv_dtype: torch.dtype, num_blocks: int = 64) -> KVPool:
    cfg = model.config
    pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, num_blocks, BS, kv_dtype,
                  torch.device("cpu"))
    pool.zero(list(range(num_blocks)))
    return pool


def _tables(B: int, T: int) -> list[list[int]]:
    """Scattered, interleaved block ids (never 0): row b's j-th block is 1 + j*B + (B-1-b)."""
    nb = -(-T // BS)
    return [[1 + j * B + (B - 1 - b) for j in range(nb)] for b in range(B)]


def _decode_logits(dtype: torch.dtype, tokens_B_T: torch.Tensor, prompt_lens: list[int],
                   kv_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, KVPool]:
    """Prefill each row's prompt (rows starting at 0), then decode the rest one token per
    step, rows at different positions; the logits of every decoded position (B, steps, V)."""
    model = load_model("tiny", dtype=dtype, seed=1).clone_for_inference()
    pool = _pool(model, kv_dtype)
    B, T = tokens_B_T.shape
    tables = _tables(B, T)
    out = []
    with torch.inference_mode():
        width = max(prompt_lens)
        padded = torch.stack([torch.cat((row[:n], row.new_zeros(width - n)))
                              for row, n in zip(tokens_B_T, prompt_lens)])
        view = pool.view(tables, [0] * B, prompt_lens, width)
        model(padded, view.positions_R_T, kv=view, last_only=True, last_index_B=view.last_index_R)
        pos = list(prompt_lens)
        while min(pos) < T:
            pos = [min(p, T - 1) for p in pos]
            step_tokens = tokens_B_T.gather(1, torch.tensor(pos).unsqueeze(1))
            view = pool.view(tables, pos, [1] * B, 1)
            logits = model(step_tokens, view.positions_R_T, kv=view, last_only=True)
            out.append(logits[:, 0])
            pos = [p + 1 for p in pos]
    return torch.stack(out, dim=1), pool


def test_bf16_model_keeps_exact_bf16_values_in_fp32_blocks() -> None:
    tokens = torch.randint(0, 4096, (2, 10), generator=torch.Generator().manual_seed(0))
    _, pool = _decode_logits(torch.bfloat16, tokens, [9, 6])
    assert pool.k.abs().sum() > 0
    assert torch.equal(pool.k, pool.k.bfloat16().float())  # storing in fp32 loses nothing
    assert torch.equal(pool.v, pool.v.bfloat16().float())


def test_decode_with_cache_matches_uncached_in_fp32_and_bf16() -> None:
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 4096, (3, 20), generator=gen)
    for dtype, kv_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                            (torch.bfloat16, torch.bfloat16)):
        cached, _ = _decode_logits(dtype, tokens, [14, 14, 14], kv_dtype)
        model = load_model("tiny", dtype=dtype, seed=1).clone_for_inference()
        with torch.inference_mode():
            full = model(tokens)[:, 14:]
        tol = 1e-5 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(cached, full, atol=tol, rtol=0)


def test_rows_at_different_positions_in_scattered_blocks() -> None:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 4096, (3, 12), generator=gen)
    cached, _ = _decode_logits(torch.float32, tokens, [4, 9, 11])
    model = load_model("tiny", seed=1).clone_for_inference()
    with torch.inference_mode():
        full = model(tokens)
    # row 0 decodes positions 4..11 (8 steps); the others stop at 11, repeating it
    torch.testing.assert_close(cached[0], full[0, 4:], atol=1e-5, rtol=0)
    torch.testing.assert_close(cached[1, :3], full[1, 9:], atol=1e-5, rtol=0)
    torch.testing.assert_close(cached[2, 0], full[2, 11], atol=1e-5, rtol=0)


def test_prefill_after_a_cached_prefix_and_copied_partial_block() -> None:
    """Row 0 computes positions 6..11 after keys 0..5, of which 4..5 were copied from
    another block (a partial-block hit), in one forward with a row starting at 0."""
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 4096, (2, 12), generator=gen)
    model = load_model("tiny", seed=1).clone_for_inference()
    pool = _pool(model, torch.float32)
    with torch.inference_mode():
        full = model(tokens)
        first = pool.view([[1, 2]], [0], [6], 6)  # row 0's first 6 positions, elsewhere
        model(tokens[:1, :6], first.positions_R_T, kv=first, last_only=True)
        pool.copy_block(2, 5, 2)  # positions 4..5 into the row's own block
        view = pool.view([[1, 5, 6], [7, 8, 9]], [6, 0], [6, 12], 12)
        padded = torch.stack((torch.cat((tokens[0, 6:], tokens.new_zeros(6))), tokens[1]))
        logits = model(padded, view.positions_R_T, kv=view)
    torch.testing.assert_close(logits[0, :6], full[0, 6:], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1], full[1], atol=1e-5, rtol=0)


class _Row:  # a decode workspace row: any object a weak reference can point to
    pass


def test_decode_rows_at_one_position_attend_without_a_mask_bit_for_bit() -> None:
    """Rows at one position see every key: the decode view hands no mask, and the logits
    equal, bit for bit, those of the same step under an all-zero mask."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 4096, (3, 9), generator=gen)
    model = load_model("tiny", seed=1).clone_for_inference()
    pool = _pool(model, torch.float32)
    tables, rows = _tables(3, 9), [_Row() for _ in range(3)]
    with torch.inference_mode():
        prefill = pool.view(tables, [0, 0, 0], [8, 8, 8], 8)
        model(tokens[:, :8], prefill.positions_R_T, kv=prefill, last_only=True)
        workspace = DecodeWorkspace(pool, rows, tables, 9)
        view = DecodeView(pool, workspace, tables, [8, 8, 8])
        assert view.masks[0] is None
        unmasked = model(tokens[:, 8:], view.positions_R_T, kv=view, last_only=True)
        view.masks[0] = torch.zeros(3, 1, 1, 9)
        masked = model(tokens[:, 8:], view.positions_R_T, kv=view, last_only=True)
        full = model(tokens)[:, 8]
        uneven = DecodeView(pool, workspace, tables, [8, 7, 8]).masks[0]
    assert torch.equal(unmasked, masked)
    torch.testing.assert_close(unmasked[:, 0], full, atol=1e-5, rtol=0)
    assert uneven is not None and torch.isinf(uneven[1, 0, 0, 8]) and uneven[0].eq(0).all()


def test_a_workspace_gathered_into_a_replaced_ones_storage_decodes_the_same() -> None:
    """A workspace that reuses the storage of the one it replaces (stale values in it)
    decodes bit for bit as one gathered into fresh memory; storage too small, or over
    twice the size needed, is not reused."""
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, 4096, (3, 9), generator=gen)
    model = load_model("tiny", seed=1).clone_for_inference()
    pool = _pool(model, torch.float32)
    tables = _tables(3, 9)
    with torch.inference_mode():
        prefill = pool.view(tables, [0, 0, 0], [8, 8, 8], 8)
        model(tokens[:, :8], prefill.positions_R_T, kv=prefill, last_only=True)
        rows = [_Row() for _ in range(3)]
        old = DecodeWorkspace(pool, rows, tables, 9)
        old.k.fill_(7.0)  # stale values a reuse must overwrite
        old.v.fill_(-7.0)
        fresh = DecodeWorkspace(pool, [_Row() for _ in range(3)], tables, 9)
        reused = DecodeWorkspace(pool, [_Row() for _ in range(3)], tables, 9, reuse=old)
        assert reused.storage[0].data_ptr() == old.storage[0].data_ptr()
        logits = [model(tokens[:, 8:], view.positions_R_T, kv=view, last_only=True)
                  for view in (DecodeView(pool, ws, tables, [8, 8, 8]) for ws in (fresh, reused))]
        one = DecodeWorkspace(pool, [_Row()], tables[:1], 9, reuse=old)  # old: over 2x
        more = DecodeWorkspace(pool, [_Row() for _ in range(3)], tables, 300, reuse=old)
    assert torch.equal(logits[0], logits[1])
    assert one.storage[0].data_ptr() != old.storage[0].data_ptr()
    assert more.storage[0].data_ptr() != old.storage[0].data_ptr()


def test_bf16_pool_stores_bf16_and_samples_the_bits_of_an_fp32_pool() -> None:
    """A bf16 model's pool stores bf16 (`kv_cache_dtype="auto"`): twice the blocks in the
    same bytes, and, attention reading fp32 either way, the same tokens and logprobs bit
    for bit as the fp32 pool, through cache hits, a prefill after a hit and decode steps
    of rows at different positions."""
    services = [LocalService("tiny", seed=3, dtype="bfloat16", cache_bytes=2**22,
                             thread_tuning=False, kv_cache_dtype=kind)
                for kind in ("auto", "float32")]
    half, full = (svc.engine.runner.pool for svc in services)
    assert (half.dtype, half.attend_dtype, full.dtype) == (torch.bfloat16, torch.float32,
                                                            torch.float32)
    assert half.num_blocks == 2 * full.num_blocks
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    answers: list[list[tuple[list[int], list[float]]]] = []
    for svc in services:
        client = svc.create_sampling_client(stop_at_end_of_turn=False)
        prompt = list(range(5, 45))
        first = client.sample(ModelInput.from_ints(prompt), num_samples=4,
                              sampling_params=params).result().sequences
        seen = [(s.tokens, s.logprobs) for s in first]
        # each sample's conversation goes on: the first prompt is a hit, rows differ in length
        later = [client.sample(ModelInput.from_ints(prompt + s.tokens + list(range(9, 9 + 3 * i))),
                               sampling_params=params) for i, s in enumerate(first)]
        seen += [(s.tokens, s.logprobs) for f in later for s in f.result().sequences]
        assert svc.cache_stats()["hit_tokens"] >= 4 * 32
        answers.append(seen)
        svc.close()
    assert answers[0] == answers[1]
