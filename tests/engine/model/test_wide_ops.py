"""Narrow decode steps (engine/model/wide_ops.py): small ops on one thread, the packed
linears and attention on the step's count, the same bits as a step run wide."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import prefixgym as pg
from prefixgym.engine.model import ModelConfig, Transformer
from prefixgym.engine.model import onednn_linear as onednn
from prefixgym.engine.model import packed as packing
from prefixgym.engine.model.packed import WeightPacker, packs
from prefixgym.engine.model.wide_ops import narrow, wide
from prefixgym.engine.sampler import runner
from prefixgym.engine.service import EngineService

CONFIG = ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     hidden_dim=128, max_seq_len=128)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_narrow_runs_one_thread_and_wide_the_steps_count(two_threads: None) -> None:
    with wide():  # outside narrow: nothing changes
        assert torch.get_num_threads() == 2
    with narrow(1):
        assert torch.get_num_threads() == 2
    with narrow(2):
        assert torch.get_num_threads() == 1
        with wide():
            assert torch.get_num_threads() == 2
            with wide():  # nested: still wide, and after it too
                assert torch.get_num_threads() == 2
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="boom"), narrow(2), wide():
        raise ValueError("boom")
    assert torch.get_num_threads() == 2
    with wide():  # an error inside left no narrow state behind
        assert torch.get_num_threads() == 2


def test_another_threads_ops_are_not_narrowed(two_threads: None) -> None:
    seen: list[int] = []

    def other() -> None:
        torch.set_num_threads(2)
        with wide():
            seen.append(torch.get_num_threads())

    with narrow(2):
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert torch.get_num_threads() == 1
    assert seen == [2]


def _packed_model(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> Transformer:
    monkeypatch.setattr(packing, "MIN_ELEMENTS", 0)  # this file's model is small
    model = Transformer(CONFIG).to(dtype).eval()
    if not packs(model):
        pytest.skip(f"this torch or CPU packs no {dtype} linear")
    return WeightPacker(counts=(1,)).pack(model, shared=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_narrow_forward_gives_the_bits_of_a_wide_one(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, two_threads: None) -> None:
    model = _packed_model(dtype, monkeypatch)
    assert model.narrow_steps
    counts: list[int] = []
    real = onednn._mkldnn._linear_pointwise

    class Recording:
        @staticmethod
        def _linear_pointwise(*args: object) -> torch.Tensor:
            counts.append(torch.get_num_threads())
            return real(*args)  # type: ignore[no-any-return]

    tokens = torch.randint(0, CONFIG.vocab_size, (16, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(tokens)
        monkeypatch.setattr(onednn, "_mkldnn", Recording)
        with narrow(2):
            narrowed = model(tokens)
    assert torch.equal(plain, narrowed)
    assert counts and set(counts) == {2}  # every linear ran on the step's count


def test_only_a_model_packed_whole_runs_narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Transformer(CONFIG).narrow_steps
    _packed_model(torch.float32, monkeypatch)  # (skips where nothing packs)
    model = Transformer(CONFIG)
    WeightPacker(enabled=False).pack(model, shared=True)
    assert not model.narrow_steps
    # the MLP's down projection (128 x 64) below the threshold stays on F.linear
    monkeypatch.setattr(packing, "MIN_ELEMENTS", CONFIG.dim * CONFIG.hidden_dim + 1)
    model = Transformer(CONFIG)
    WeightPacker(counts=(1,)).pack(model, shared=True)
    assert isinstance(model.layers[0].mlp.w_down, torch.nn.Linear) and not model.narrow_steps


def test_the_sampler_runs_decode_steps_narrow_with_the_same_tokens(
        monkeypatch: pytest.MonkeyPatch, two_threads: None) -> None:
    monkeypatch.setattr(packing, "MIN_ELEMENTS", 0)
    if not packs(Transformer(CONFIG)):
        pytest.skip("this torch packs no fp32 linear")
    calls: list[int] = []
    real_narrow = runner.narrow

    @contextmanager
    def recorded(threads: int) -> Iterator[None]:
        calls.append(threads)
        with real_narrow(threads):
            yield

    def run() -> tuple[list[list[int]], list[list[float]]]:
        with EngineService(CONFIG, seed=1, thread_tuning=False) as svc:
            client = svc.create_sampling_client(stop_at_end_of_turn=False)
            params = pg.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
            out = client.sample(list(range(3, 30)), num_samples=3, sampling_params=params)
            result = out.result()
        return [s.tokens for s in result.sequences], [s.logprobs for s in result.sequences]

    monkeypatch.setattr(runner, "narrow", recorded)
    narrowed = run()
    assert calls[0] == 1 and set(calls[1:]) == {2}  # the prefill wide, 5 decode steps narrow
    assert len(calls) == 6
    monkeypatch.setattr(runner, "narrow", lambda threads: real_narrow(1))
    assert run() == narrowed
