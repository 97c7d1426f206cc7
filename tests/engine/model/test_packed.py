"""Sampling on oneDNN's packed weights (`engine/model/packed.py`): the same model, the
weights it should see, no gradient, and nothing packed where it must not be."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import prefixgym as pg
from prefixgym.engine.model import ModelConfig, Transformer, lora
from prefixgym.engine.model import onednn_linear as onednn
from prefixgym.engine.model import packed as packing
from prefixgym.engine.model.packed import PackedLinear, WeightPacker, packed_layers, packs
from prefixgym.engine.service import EngineService

CONFIG = ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     hidden_dim=128, max_seq_len=128, qkv_bias=True)
PROMPT = list(range(3, 40))
LINEARS = 2 * 4  # per block: wqkv, wo, w_gate_up, w_down

pytestmark = pytest.mark.skipif(not packs(Transformer(CONFIG)),
                                reason="this torch has no oneDNN packed linear")


@pytest.fixture(autouse=True)
def small_weights_pack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(packing, "MIN_ELEMENTS", 0)  # this file's model is small
    # each test checks shapes afresh: no answers kept by an earlier run or test
    monkeypatch.setenv("PREFIXGYM_CACHE_DIR", str(tmp_path / "cache"))


def service(config: ModelConfig = CONFIG, **kwargs: object) -> EngineService:
    return EngineService(config, seed=1, thread_tuning=False, **kwargs)  # type: ignore[arg-type]


def sample(svc: EngineService, client: pg.SamplingClient | None = None,
           ) -> tuple[list[list[int]], list[list[float]], list[float]]:
    client = client or svc.create_sampling_client(stop_at_end_of_turn=False)
    params = pg.SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    out = client.sample(PROMPT, num_samples=4, sampling_params=params).result()
    prompt = client.compute_logprobs(PROMPT + out.sequences[0].tokens).result()
    return ([s.tokens for s in out.sequences], [s.logprobs for s in out.sequences],
            [x for x in prompt if x is not None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [True, False])
def test_a_packed_layer_computes_the_linear(dtype: torch.dtype, shared: bool) -> None:
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 here")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    layer = PackedLinear(weight, bias, shared=shared)
    for rows in (1, 7, 40):
        x = torch.randn(3, rows, 64, generator=gen).to(dtype)
        want = F.linear(x.float(), weight.float(), bias.float())
        got = layer(x)
        assert got.shape == (3, rows, 96) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 0.08
        assert torch.allclose(got.float(), want, atol=tol, rtol=tol)
    assert (layer.source is not None) == shared


def test_a_shared_layer_follows_its_weight_changed_in_place() -> None:
    weight = torch.randn(32, 16)
    layer = PackedLinear(weight, None, shared=True)
    x = torch.randn(2, 16)
    before = layer(x)
    with torch.no_grad():
        weight.mul_(2.0)
    assert torch.allclose(layer(x), 2 * before, atol=1e-5)
    private = PackedLinear(weight, None, shared=False)
    with torch.no_grad():
        weight.zero_()
    assert torch.allclose(private(x), 2 * before, atol=1e-5)  # packed for good


def test_a_packed_layer_refuses_a_gradient() -> None:
    layer = PackedLinear(torch.randn(8, 4), None, shared=False)
    with pytest.raises(RuntimeError, match="no gradient"):
        layer(torch.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        assert layer(torch.randn(2, 4, requires_grad=True)).shape == (2, 8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_and_plain_sample_alike(dtype: str) -> None:
    if dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 here")
    with service(dtype=dtype) as packed, service(dtype=dtype, pack_weights=False) as plain:
        model = packed.create_sampling_client()._model
        assert len(packed_layers(model)) == LINEARS + 1  # the head too
        assert packed_layers(plain.create_sampling_client()._model) == []
        tokens, logprobs, prompt = sample(packed)
        want_tokens, want_logprobs, want_prompt = sample(plain)
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs):
            assert got == pytest.approx(want, abs=1e-5)
        assert prompt == pytest.approx(want_prompt, abs=1e-5)


def test_version_0_follows_the_trainers_weights_until_they_are_unshared() -> None:
    with service() as svc, service(pack_weights=False) as plain:
        v0 = svc.create_sampling_client(stop_at_end_of_turn=False)
        first = v0.compute_logprobs(PROMPT).result()[1:]
        with torch.no_grad():  # what a load into the shared weights does
            for model in (svc.train_model, plain.train_model):
                model.layers[0].attn.wqkv.weight.mul_(0.5)
                model.tok_embeddings.weight.add_(0.01)
        changed = v0.compute_logprobs(PROMPT).result()[1:]
        assert changed != pytest.approx(first, abs=1e-4)
        want = plain.create_sampling_client().compute_logprobs(PROMPT).result()[1:]
        assert changed == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_a_full_publish_is_packed_in_place_and_lora_shares_one_packed_base(tied: bool) -> None:
    config = dataclasses.replace(CONFIG, tie_embeddings=tied)
    with service(config) as svc:
        full = svc.create_training_client()
        datum = pg.Datum(model_input=pg.ModelInput.from_ints(PROMPT[:-1]),
                         loss_fn_inputs={"target_tokens": PROMPT[1:]})
        full.forward_backward([datum], "cross_entropy").result()
        full.optim_step(pg.AdamParams(learning_rate=1e-2)).result()
        v1 = full.save_weights_and_get_sampling_client()
        layers = packed_layers(v1._model)
        assert len(layers) == LINEARS + 1
        # private: packed at once, no dense weight kept (a tied head's is the embedding)
        assert all(layer.source is None for layer in layers)
        names = {name for name, _ in v1._model.named_parameters()}
        assert not any(name.endswith(("wqkv.weight", "w_down.weight")) for name in names)
        trained = full.forward([datum], "cross_entropy").result()
        sampled = v1.compute_logprobs(PROMPT).result()
        assert trained.loss_fn_outputs[0]["logprobs"] == pytest.approx(sampled[1:], abs=1e-4)
    with service(config) as svc:
        lora = svc.create_lora_training_client(rank=4)
        v0 = svc.create_sampling_client()
        v1 = lora.save_weights_and_get_sampling_client()
        bases = packed_layers(v1._model)
        assert len(bases) == LINEARS + 1 and bases == packed_layers(v0._model)


def test_a_private_pack_runs_beside_on_one_thread_and_leaves_the_model_when_it_raises(
        ) -> None:
    """`beside` (a publish's checks) runs on the helper thread with the head while the
    blocks pack; the caller's thread count is its own after; what `beside` raises comes
    out of `pack`, with the model as it was."""
    config = dataclasses.replace(CONFIG, tie_embeddings=True)
    packer = WeightPacker()
    seen: list[tuple[str, int]] = []
    threads: list[threading.Thread] = []

    def beside() -> None:
        threads.append(threading.current_thread())
        seen.append((threads[-1].name, torch.get_num_threads()))

    def failing() -> None:
        raise ValueError("not publishing weights: the probe says no")

    before = torch.get_num_threads()
    model = packer.pack(lora.frozen_copy(Transformer(config)), shared=False, beside=beside)
    assert len(seen) == 1 and seen[0][0].startswith("prefixgym-pack") and seen[0][1] == 1
    assert torch.get_num_threads() == before and len(packed_layers(model)) == LINEARS + 1
    untouched = lora.frozen_copy(Transformer(config))
    with pytest.raises(ValueError, match="the probe says no"):
        packer.pack(untouched, shared=False, beside=failing)
    assert not packed_layers(untouched) and untouched.head_linear is None
    assert torch.get_num_threads() == before
    shared = packer.pack(lora.frozen_copy(Transformer(config)), shared=True, beside=beside)
    assert seen[1] == (threading.current_thread().name, before)  # nothing to run beside
    assert len(packed_layers(shared)) == LINEARS + 1
    packer.close()
    assert not threads[0].is_alive()


def test_a_full_publish_copies_into_a_freed_versions_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora, "SPARE_MIN_BYTES", 0)  # every copy: this model is small
    config = dataclasses.replace(CONFIG, tie_embeddings=True)
    datum = pg.Datum(model_input=pg.ModelInput.from_ints(PROMPT[:-1]),
                     loss_fn_inputs={"target_tokens": PROMPT[1:]})
    with service(config) as svc, service(config) as fresh:
        full = svc.create_training_client()
        copied: list[set[int]] = []
        for _ in range(4):  # each version dropped once the next one is out
            full.forward_backward([datum], "cross_entropy").result()
            full.optim_step(pg.AdamParams(learning_rate=1e-2)).result()
            client = full.save_weights_and_get_sampling_client()
            copied.append({p.data_ptr() for p in client._model.parameters()})
            assert torch.equal(client._model.tok_embeddings.weight,
                               svc.train_model.tok_embeddings.weight)
        assert copied[2] == copied[0] and copied[3] == copied[1]  # two sets in turn
        assert copied[0].isdisjoint(copied[1])
        fresh.train_model.load_weights_from(svc.train_model)  # the same weights, new copies
        other = fresh.create_training_client().save_weights_and_get_sampling_client()
        assert sample(svc, client) == sample(fresh, other)


def test_a_shape_that_rounds_by_thread_count_stays_plain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onednn, "_thread_invariant", lambda *args: False)
    model = Transformer(CONFIG)
    WeightPacker(counts=(1,)).pack(model, shared=True)
    assert len(packed_layers(model)) == LINEARS + 1  # one thread count: no check
    model = Transformer(CONFIG)
    WeightPacker(counts=(1, 2)).pack(model, shared=True)
    assert packed_layers(model) == [] and model.head_linear is None
    assert isinstance(model.layers[0].attn.wqkv, torch.nn.Linear)
    model = Transformer(CONFIG).to(torch.bfloat16)  # oneDNN either way
    if packs(model):
        WeightPacker(counts=(1, 2)).pack(model, shared=True)
        assert len(packed_layers(model)) == LINEARS + 1


def test_the_thread_check_runs_each_shape_once_on_every_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counts: list[int] = []
    real = onednn.packed_product

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        counts.append(torch.get_num_threads())
        return real(x, w, b)

    monkeypatch.setattr(onednn, "packed_product", counted)
    before = torch.get_num_threads()
    first = onednn._thread_invariant(torch.randn(48, 33), None, (1, 2))
    assert counts == [1, 2] * len(onednn.CHECKED_ROWS)
    assert torch.get_num_threads() == before
    assert onednn._thread_invariant(torch.randn(48, 33), None, (1, 2)) is first
    assert len(counts) == 2 * len(onednn.CHECKED_ROWS)  # the shape's answer was kept


def test_a_shapes_answer_is_kept_for_later_processes_on_the_same_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[tuple[int, int]] = []
    real = onednn._thread_invariant

    def counted(weight: torch.Tensor, bias: torch.Tensor | None,
                counts: tuple[int, ...]) -> bool:
        checked.append(tuple(weight.shape))
        return real(weight, bias, counts)

    monkeypatch.setattr(onednn, "_thread_invariant", counted)
    WeightPacker(counts=(1, 2)).pack(Transformer(CONFIG), shared=True)
    shapes = len(checked)
    assert shapes == 5  # wqkv, wo, w_gate_up, w_down, the head: once each
    assert len(onednn._read_store(onednn.verdicts_path())) == shapes
    # a new process on this machine: nothing in memory, every answer read back
    monkeypatch.setattr(onednn, "_stored", {})
    model = Transformer(CONFIG)
    WeightPacker(counts=(1, 2)).pack(model, shared=True)
    assert len(checked) == shapes and len(packed_layers(model)) == LINEARS + 1
    # another CPU or torch build checks afresh
    monkeypatch.setattr(onednn, "_stored", {})
    monkeypatch.setattr(onednn, "_machine", lambda: "another machine")
    WeightPacker(counts=(1, 2)).pack(Transformer(CONFIG), shared=True)
    assert len(checked) == 2 * shapes


def test_a_store_that_cannot_be_written_or_read_only_costs_the_check(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("PREFIXGYM_CACHE_DIR", str(tmp_path / "a file"))  # no directory there
    model = Transformer(CONFIG)
    WeightPacker(counts=(1, 2)).pack(model, shared=True)
    assert len(packed_layers(model)) == LINEARS + 1
    monkeypatch.setenv("PREFIXGYM_CACHE_DIR", str(tmp_path))
    onednn.verdicts_path().write_text("{not json")
    model = Transformer(CONFIG)
    WeightPacker(counts=(1, 2)).pack(model, shared=True)
    assert len(packed_layers(model)) == LINEARS + 1
    assert len(onednn._read_store(onednn.verdicts_path())) == 5  # written anew


def test_small_weights_stay_on_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packing, "MIN_ELEMENTS", CONFIG.dim * CONFIG.hidden_dim * 2)
    model = Transformer(CONFIG)
    WeightPacker().pack(model, shared=True)
    big = [CONFIG.dim * 2 * CONFIG.hidden_dim, CONFIG.dim * CONFIG.vocab_size]  # gate_up, head
    assert sorted(layer.in_features * layer.out_features for layer in packed_layers(model)) \
        == sorted([big[0]] * CONFIG.n_layers + [big[1]])


def test_the_counts_checked_are_the_cpus_not_the_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onednn.os, "cpu_count", lambda: 6)
    assert onednn.thread_counts() == (1, 2, 4, 6)
    monkeypatch.setattr(onednn.os, "cpu_count", lambda: 8)
    assert onednn.thread_counts() == (1, 2, 4, 8)
    monkeypatch.setattr(onednn.os, "cpu_count", lambda: 1)
    assert onednn.thread_counts() == (1,)
    assert WeightPacker().counts == (1,)


@pytest.mark.parametrize("packed", [True, False])
def test_a_full_publish_packs_the_trainers_weights_and_never_shares_them(
        monkeypatch: pytest.MonkeyPatch, packed: bool) -> None:
    """The weights a publish packs are not copied first, and whatever it does not pack
    (here: nothing, as if every shape rounded by thread count) is copied: training after
    a publish never changes the published version."""
    if not packed:
        monkeypatch.setattr(WeightPacker, "_shared_layer", lambda self, layer: None)
        monkeypatch.setattr(WeightPacker, "_private_layers",
                            lambda self, layers: [None] * len(layers))
    with service() as svc:
        trainer = svc.create_training_client()
        v1 = trainer.save_weights_and_get_sampling_client()
        assert len(packed_layers(v1._model)) == (LINEARS + 1 if packed else 0)
        theirs = {p.untyped_storage().data_ptr() for p in svc.train_model.parameters()}
        assert not any(p.untyped_storage().data_ptr() in theirs
                       for p in v1._model.parameters())
        before = sample(svc, v1)
        with torch.no_grad():
            for param in svc.train_model.parameters():
                param.add_(0.5)
        tokens, logprobs, prompt = sample(svc, v1)  # (a cache hit: float noise only)
        assert tokens == before[0] and prompt == pytest.approx(before[2], abs=1e-5)
        assert logprobs[0] == pytest.approx(before[1][0], abs=1e-5)
        changed = sample(svc, trainer.save_weights_and_get_sampling_client())[2]
        assert changed != pytest.approx(before[2], abs=1e-2)
