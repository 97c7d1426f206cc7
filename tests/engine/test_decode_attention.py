"""Decode steps over slot KV: fp32 slots for a bf16 model, rows at their own positions."""

from __future__ import annotations

import torch

from prefixgym.engine.kv_slots import SlotKV
from prefixgym.engine.model import load_model


def test_bf16_model_keeps_exact_bf16_values_in_fp32_slots() -> None:
    model = load_model("tiny", dtype=torch.bfloat16, seed=1).clone_for_inference()
    cfg = model.config
    kv = SlotKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.max_seq_len, torch.float32, slots=2)
    tokens = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        view = kv.prefill_view(0, [0, 0], [9, 6])
        model(tokens, view.positions_R_T, kv=view, last_only=True, last_index_B=view.last_index_R)
        model(tokens[:, :1], torch.tensor([[9], [6]]), kv=kv.decode_view(torch.tensor([9, 6])))
    stored = kv.k[:, 0, :, :10]
    assert stored.abs().sum() > 0
    assert torch.equal(stored, stored.bfloat16().float())  # storing in fp32 loses nothing
    assert torch.equal(kv.v[:, 1, :, :7], kv.v[:, 1, :, :7].bfloat16().float())


def _decode_logits(dtype: torch.dtype, tokens_B_T: torch.Tensor, prompt_lens: list[int],
                   kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Prefill each row's prompt, then decode the rest one token per step (rows at
    different positions); returns the logits of every decoded position, (B, steps, V)."""
    model = load_model("tiny", dtype=dtype, seed=1).clone_for_inference()
    cfg = model.config
    B, T = tokens_B_T.shape
    kv = SlotKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.max_seq_len, kv_dtype, slots=B)
    out = []
    with torch.inference_mode():
        view = kv.prefill_view(0, [0] * B, prompt_lens)
        padded = torch.stack([torch.cat((row[:n], row.new_zeros(max(prompt_lens) - n)))
                              for row, n in zip(tokens_B_T, prompt_lens)])
        model(padded, view.positions_R_T, kv=view, last_only=True, last_index_B=view.last_index_R)
        pos_B = torch.tensor(prompt_lens)
        while int(pos_B.min()) < T:
            pos_B = pos_B.clamp(max=T - 1)
            step_tokens = tokens_B_T.gather(1, pos_B.unsqueeze(1))
            logits = model(step_tokens, pos_B.unsqueeze(1), kv=kv.decode_view(pos_B), last_only=True)
            out.append(logits[:, 0])
            pos_B = pos_B + 1
    return torch.stack(out, dim=1)


def test_bf16_decode_with_cache_matches_uncached_bf16_and_fp32() -> None:
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 4096, (3, 20), generator=gen)
    prompt_lens = [20 - 6, 20 - 6, 20 - 6]  # equal prompts: every row decodes 6 positions
    for dtype, kv_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                            (torch.bfloat16, torch.bfloat16)):
        cached = _decode_logits(dtype, tokens, prompt_lens, kv_dtype)
        model = load_model("tiny", dtype=dtype, seed=1).clone_for_inference()
        with torch.inference_mode():
            full = model(tokens)[:, 14:]
        tol = 1e-5 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(cached, full, atol=tol, rtol=0)
    fp32 = load_model("tiny", seed=1).clone_for_inference()
    with torch.inference_mode():
        reference = fp32(tokens)[:, 14:]
    drift = (_decode_logits(torch.bfloat16, tokens, prompt_lens) - reference).abs().max()
    assert float(drift) < 0.05


def test_decode_rows_at_different_positions_write_their_own_slots() -> None:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 4096, (3, 12), generator=gen)
    cached = _decode_logits(torch.float32, tokens, [4, 9, 11])
    model = load_model("tiny", seed=1).clone_for_inference()
    with torch.inference_mode():
        full = model(tokens)
    # row 0 decodes positions 4..11 (8 steps); the others stop at 11, repeating it
    torch.testing.assert_close(cached[0], full[0, 4:], atol=1e-5, rtol=0)
    torch.testing.assert_close(cached[1, :3], full[1, 9:], atol=1e-5, rtol=0)
    torch.testing.assert_close(cached[2, 0], full[2, 11], atol=1e-5, rtol=0)
