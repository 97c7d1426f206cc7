"""Decode attention over keys that rows share (shared_keys.py): the plan of segments, the
merge by log-sum-exp, and the engine with it against the engine without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixgym.engine.model import ModelConfig, SharedKeys, Transformer
from prefixgym.engine.model.shared_attention import attend_shared
from prefixgym.engine.sampler import runner as runner_module
from prefixgym.engine.sampler.shared_keys import SharedPlan
from prefixgym.local_service import LocalService
from prefixgym.types import ModelInput, SamplingParams

BS = 4


def test_plan_finds_nested_runs_and_leaves_each_row_its_own_keys() -> None:
    # rows 0-3 share blocks 1, 2; rows 0-2 then 3, 4; row 3 goes its own way; row 4
    # shares only block 1 with them (too short alone: read with its own keys)
    tables = [[1, 2, 3, 4, 10], [1, 2, 3, 4, 11], [1, 2, 3, 4, 12], [1, 2, 5, 6], [1, 7, 8]]
    starts = [4 * BS + 1, 4 * BS + 2, 4 * BS + 3, 3 * BS, 2 * BS + 1]
    plan = SharedPlan.of(tables, starts, BS)
    assert plan.segments == [([0, 1, 2, 3], 0, 2), ([0, 1, 2], 2, 4)]
    assert plan.offsets == [4 * BS, 4 * BS, 4 * BS, 2 * BS, 0]
    assert plan.extent(starts) == 2 * BS + 2  # row 4: positions 0 .. 2*BS


def test_plan_shares_only_blocks_before_the_one_a_row_writes() -> None:
    # both rows hold blocks 1, 2, 3, but row 1 writes into block 3 (position 2*BS+1):
    # only blocks 1, 2 are shared, block 3 stays row 0's and row 1's own
    tables = [[1, 2, 3, 9], [1, 2, 3]]
    plan = SharedPlan.of(tables, [3 * BS + 1, 2 * BS + 1], BS)
    assert plan.segments == [([0, 1], 0, 2)]
    assert plan.offsets == [2 * BS, 2 * BS]
    # a run of one block alone is not a segment; nothing shared, nothing offset
    assert SharedPlan.of([[1, 5], [1, 6]], [2 * BS, 2 * BS], BS) == SharedPlan.none(2)


def test_merge_equals_attention_over_every_key_of_each_row() -> None:
    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, D = 5, 4, 2, 16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k, v = randn(B, H, 1, D), randn(B, Hkv, 6, D), randn(B, Hkv, 6, D)
    own = torch.tensor([3, 5, 2, 6, 4])  # each row's own keys: the first own[r]
    mask = torch.zeros(B, 1, 1, 6).masked_fill_(
        (torch.arange(6) >= own.unsqueeze(1))[:, None, None], float("-inf"))
    # segment a: rows 0-2, 8 keys; b: rows 3, 4, 4 keys; c: rows 0, 1, 6 keys (nested in a)
    segments = {"a": ([0, 1, 2], 8), "b": ([3, 4], 4), "c": ([0, 1], 6)}
    keys = {name: (randn(Hkv, n, D), randn(Hkv, n, D)) for name, (_, n) in segments.items()}

    def part(names: list[str]) -> SharedKeys:
        T = max(segments[n][1] for n in names)
        k_S = torch.zeros(len(names), Hkv, T, D)
        v_S = torch.zeros(len(names), Hkv, T, D)
        for i, n in enumerate(names):
            k_S[i, :, : segments[n][1]], v_S[i, :, : segments[n][1]] = keys[n]
        lengths = torch.tensor([segments[n][1] for n in names])
        pad = torch.zeros(len(names), 1, 1, T).masked_fill_(
            (torch.arange(T) >= lengths.unsqueeze(1))[:, None, None], float("-inf"))
        return SharedKeys(k_S, v_S, pad, torch.tensor([segments[n][0] for n in names]))

    got = attend_shared(q, k, v, mask, [part(["a"]), part(["b", "c"])], None)
    for r in range(B):
        mine = [keys[n] for n, (rows, _) in segments.items() if r in rows]
        k_r = torch.cat([kk for kk, _ in mine] + [k[r, :, : own[r]]], dim=1)
        v_r = torch.cat([vv for _, vv in mine] + [v[r, :, : own[r]]], dim=1)
        want = F.scaled_dot_product_attention(q[r : r + 1], k_r[None], v_r[None],
                                              enable_gqa=True)
        torch.testing.assert_close(got[r : r + 1], want, atol=1e-6, rtol=0)


def test_a_segment_of_every_row_is_merged_in_place_with_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(1)
    B, H, Hkv, D = 4, 6, 2, 8
    q, k, v = (torch.randn(*shape, generator=gen)
               for shape in ((B, H, 1, D), (B, Hkv, 5, D), (B, Hkv, 5, D)))
    mask = torch.zeros(B, 1, 1, 5)
    mask[1, ..., 3:] = float("-inf")
    k_S, v_S = torch.randn(1, Hkv, 7, D, generator=gen), torch.randn(1, Hkv, 7, D, generator=gen)
    rows = torch.arange(B).unsqueeze(0)
    gathered = attend_shared(q, k, v, mask, [SharedKeys(k_S, v_S, None, rows)], None)
    in_place = attend_shared(q, k, v, mask, [SharedKeys(k_S, v_S, None, rows, True)], None)
    assert torch.equal(gathered, in_place)
    k_r = torch.cat((k_S.expand(B, -1, -1, -1), k), dim=2)
    v_r = torch.cat((v_S.expand(B, -1, -1, -1), v), dim=2)
    full_mask = torch.cat((torch.zeros(B, 1, 1, 7), mask), dim=-1)
    want = F.scaled_dot_product_attention(q, k_r, v_r, attn_mask=full_mask, enable_gqa=True)
    torch.testing.assert_close(in_place, want, atol=1e-6, rtol=0)


def test_only_plain_attention_without_windows_takes_shared_keys() -> None:
    base = dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                max_seq_len=128)
    assert Transformer(ModelConfig(**base)).attends_shared_keys()  # type: ignore[arg-type]
    for extra in ({"attention_softcap": 50.0}, {"attention_sinks": True},
                  {"layer_windows": (8, 0)}):
        config = ModelConfig(**base, **extra)  # type: ignore[arg-type]
        assert not Transformer(config).attends_shared_keys()


SMALL = ModelConfig(vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    hidden_dim=128, max_seq_len=512)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_samples_the_same_with_and_without_shared_keys(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPO groups over a shared system prompt, then each sample's next turn: the same
    tokens, logprobs within float noise, and the shared keys were in fact used."""
    plans: list[SharedPlan] = []
    real_of = SharedPlan.of

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        plans.append(real_of(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(runner_module.SharedPlan, "of", staticmethod(recording))
    system = list(range(100, 150))
    answers = []
    for shared in (True, False):
        recorded = len(plans)
        with LocalService(SMALL, seed=0, dtype=dtype, block_size=8, thread_tuning=False,
                          deterministic=True, shared_prefix_attention=shared) as svc:
            client = svc.create_sampling_client(stop_at_end_of_turn=False)
            params = SamplingParams(max_tokens=10, temperature=1.0, seed=5)
            prompts = [ModelInput.from_ints(system + [7 * g + i for i in range(20)])
                       for g in range(3)]
            firsts = [f.result() for f in [client.sample(p, num_samples=4, sampling_params=params)
                                           for p in prompts]]
            later = [client.sample(ModelInput.from_ints(p.to_ints() + s.tokens + [g, 9]),
                                   sampling_params=params)
                     for g, (p, r) in enumerate(zip(prompts, firsts)) for s in r.sequences]
            answers.append([s for r in [*firsts, *(f.result() for f in later)]
                            for s in r.sequences])
        if shared:  # the groups' prompts were attended once for their 4 samples
            assert any(len(rows) >= 4 for plan in plans for rows, _, _ in plan.segments)
        else:
            assert len(plans) == recorded
    numerics_tol = 1e-5 if dtype == "float32" else 0.05
    for a, b in zip(*answers):
        assert a.tokens == b.tokens
        assert a.logprobs == pytest.approx(b.logprobs, abs=numerics_tol)
