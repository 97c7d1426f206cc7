"""LoRA training clients: frozen shared base, adapters alone in the optimizer, state
save/load, bf16 autocast, shared prefixes, publishing without copying the base, and
adapters saved for a sampler loading back as the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

import prefixgym as pg
from prefixgym.engine.model import ModelConfig
from prefixgym.engine.model.lora import LoraAdapter, lora_adapters
from prefixgym.engine.model.packed import packed_layers
from prefixgym.engine.service import EngineService

CONFIG = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
                     max_seq_len=128, qkv_bias=True)
TOKENS = [(7 * i + 3) % 97 for i in range(40)]
ADAM = pg.AdamParams(learning_rate=5e-2)


def datum(tokens: list[int]) -> pg.Datum:
    return pg.Datum(model_input=pg.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:]})


def service(**kwargs: object) -> EngineService:
    return EngineService(CONFIG, thread_tuning=False, **kwargs)  # type: ignore[arg-type]


def held(model: torch.nn.Module, but: str = "") -> set[int]:
    """The storage of `model`'s weights (but those whose names hold `but`), the dense
    weights its packed layers follow included."""
    ptrs = {p.data_ptr() for n, p in model.named_parameters() if not (but and but in n)}
    for layer in packed_layers(model):
        tensors = (layer.source, layer.bias_tensor)
        ptrs |= {t.data_ptr() for t in tensors if t is not None}
    return ptrs


def train_steps(client: pg.TrainingClient, n: int, tokens: list[int] = TOKENS) -> float:
    loss = 0.0
    for _ in range(n):
        loss = client.forward_backward([datum(tokens)], "cross_entropy").result().metrics["loss"]
        client.optim_step(ADAM).result()
    return loss


def test_base_frozen_and_only_adapters_in_the_optimizer() -> None:
    with service() as svc:
        before = {k: v.clone() for k, v in svc.train_model.state_dict().items()}
        base = svc.create_sampling_client(stop_at_end_of_turn=False)
        lp_base = base.compute_logprobs(TOKENS).result()
        lora = svc.create_lora_training_client(rank=4, alpha=8.0)
        out = lora.forward([datum(TOKENS)], "cross_entropy").result()
        assert out.loss_fn_outputs[0]["logprobs"] == pytest.approx(lp_base[1:], abs=1e-6)  # B = 0
        first, last = train_steps(lora, 1), train_steps(lora, 3)
        assert last < first
        for key, value in svc.train_model.state_dict().items():
            assert torch.equal(value, before[key]), key
        assert all(p.grad is None for p in svc.train_model.parameters())
        adapters = lora_adapters(lora.model)
        assert len(adapters) == 4 * CONFIG.n_layers  # wqkv, wo, w_gate_up, w_down per layer
        optimizer = lora._optimizer
        assert optimizer is not None
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        assert in_optimizer == {id(p) for a in adapters.values() for p in a.parameters()}
        assert base.compute_logprobs(TOKENS).result() == lp_base  # old version untouched


def test_publish_shares_the_base_and_keeps_versions_apart() -> None:
    with service() as svc:
        lora = svc.create_lora_training_client(rank=4, train_unembed=True, seed=3)
        train_steps(lora, 2)
        v1 = lora.save_weights_and_get_sampling_client()
        train_steps(lora, 2)
        v2 = lora.save_weights_and_get_sampling_client()
        assert v1.weights_version != v2.weights_version == svc.weights_version
        base_ptrs = {p.data_ptr() for p in svc.train_model.parameters()}
        for version in (v1, v2):
            assert held(version._model, "lora_") == base_ptrs  # the base weights are not copied
        trained = {p.data_ptr() for a in lora_adapters(lora.model).values()
                   for p in a.parameters()}
        assert trained.isdisjoint(p.data_ptr() for p in v1._model.parameters())
        # each version samples from its own adapters, the prefix cache notwithstanding
        params = pg.SamplingParams(max_tokens=6, temperature=0.0)
        for version in (v1, v2, v1):
            resp = version.sample(TOKENS[:20], sampling_params=params).result()
            seq = resp.sequences[0]
            full = version.compute_logprobs(TOKENS[:20] + seq.tokens).result()
            assert seq.logprobs == pytest.approx(full[20:], abs=1e-4)
        fresh = lora.forward([datum(TOKENS)], "cross_entropy").result()
        lp2 = v2.compute_logprobs(TOKENS).result()
        assert fresh.loss_fn_outputs[0]["logprobs"] == pytest.approx(lp2[1:], abs=1e-5)
        assert v1.compute_logprobs(TOKENS).result() != lp2


def test_save_state_and_load_state_resume_bit_for_bit(tmp_path: Path) -> None:
    with service() as svc:
        lora = svc.create_lora_training_client(rank=4)
        train_steps(lora, 2)
        lora.save_state(tmp_path / "ckpt").result()
        weights = next((tmp_path / "ckpt").glob("weights-*.safetensors"))
        names = safetensors.torch.load_file(str(weights))
        assert names and all("lora_" in name for name in names)  # the adapters alone
        after = train_steps(lora, 2)
        state = {k: v.clone() for k, v in lora.model.state_dict().items() if "lora_" in k}
        assert lora.load_state(tmp_path / "ckpt").result() == 2
        assert train_steps(lora, 2) == after
        for key, value in lora.model.state_dict().items():
            if "lora_" in key:
                assert torch.equal(value, state[key]), key
        full = svc.create_training_client()
        full.save_state(tmp_path / "full").result()
        with pytest.raises(ValueError, match="does not match the model"):
            lora.load_state(tmp_path / "full").result()


def test_bf16_autocast_keeps_fp32_adapters_and_counts_usage() -> None:
    with service() as svc:
        ref = svc.create_lora_training_client(rank=4)
        bf16 = svc.create_lora_training_client(rank=4, compute_dtype=torch.bfloat16)
        lp32 = ref.forward([datum(TOKENS)], "cross_entropy").result()
        used = svc.usage().train_computed_tokens
        lp16 = bf16.forward_backward([datum(TOKENS)], "cross_entropy").result()
        assert lp16.loss_fn_outputs[0]["logprobs"] == pytest.approx(
            lp32.loss_fn_outputs[0]["logprobs"], abs=0.1)
        assert svc.usage().train_computed_tokens == used + len(TOKENS) - 1
        assert all(p.dtype == torch.float32 and p.grad is not None for p in bf16._params)
        bf16.optim_step(ADAM).result()


def test_shared_prefixes_give_the_plain_gradients(numerics) -> None:
    """In the test dtype: fp32 up to summation order; bf16 within its bound, relative to
    each gradient's largest entry (tests/numerics.py)."""
    branches = [TOKENS[:24] + TOKENS[30:36], TOKENS[:24] + TOKENS[5:15], TOKENS[:30]]
    grads = []
    for share in (True, False):
        with service() as svc:
            lora = svc.create_lora_training_client(rank=4, share_prefixes=share,
                                                   compute_dtype=numerics.dtype)
            out = lora.forward_backward([datum(t) for t in branches], "cross_entropy").result()
            grads.append([p.grad.clone() for p in lora._params])
            if share:
                assert out.usage.train_shared_tokens > 0
    for shared, plain in zip(*grads, strict=True):
        if numerics.is_bf16:
            limit = numerics.rel(0.0, CONFIG.n_layers) * float(plain.abs().max())
            assert float((shared - plain).abs().max()) <= limit
        else:
            torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-4)


def test_adapter_saved_for_a_sampler_loads_back(tmp_path: Path) -> None:
    with service() as svc:
        lora = svc.create_lora_training_client(rank=4, alpha=16.0, train_mlp=False,
                                               train_unembed=True)
        train_steps(lora, 2)
        path = lora.save_weights_for_sampler(tmp_path / "step-2").result()
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_alpha"] == 16.0
        assert config["target_modules"] == ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]
        published = lora.save_weights_and_get_sampling_client()
        loaded = svc.create_sampling_client(model_path=path)
        assert loaded.weights_version != published.weights_version
        assert svc.weights_version == published.weights_version  # loading publishes nothing
        assert loaded.compute_logprobs(TOKENS).result() == pytest.approx(
            published.compute_logprobs(TOKENS).result(), abs=1e-6)


def test_bad_lora_requests_are_clear_errors(tmp_path: Path) -> None:
    with service() as svc:
        with pytest.raises(ValueError, match="rank must be a positive int"):
            svc.create_lora_training_client(rank=0)
        with pytest.raises(ValueError, match="at least one of"):
            svc.create_lora_training_client(train_attn=False, train_mlp=False)
        with pytest.raises(RuntimeError, match="writes LoRA adapters"):
            svc.create_training_client().save_weights_for_sampler("x")
        with pytest.raises(FileNotFoundError, match="adapter_config.json"):
            svc.create_sampling_client(model_path=tmp_path)
        lora = svc.create_lora_training_client(rank=4)
        path = Path(lora.save_weights_for_sampler(tmp_path / "a").result())
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
        with pytest.raises(ValueError, match="DoRA"):
            svc.create_sampling_client(model_path=path)
        (path / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
        with pytest.raises(ValueError, match=r"has shape \(4, \d+\), expected \(8, \d+\)"):
            svc.create_sampling_client(model_path=path)


def test_adapter_runs_in_a_bf16_base() -> None:
    with service(dtype="bfloat16") as svc:
        lora = svc.create_lora_training_client(rank=4)
        train_steps(lora, 1)
        assert all(isinstance(a, LoraAdapter) and a.lora_A.dtype == torch.float32
                   for a in lora_adapters(lora.model).values())
        sampler = lora.save_weights_and_get_sampling_client()
        logprobs = sampler.compute_logprobs(TOKENS).result()
        assert all(lp is None or lp < 0 for lp in logprobs)


def test_version_0_shares_the_weights_until_a_full_trainer_unshares_them() -> None:
    with service() as svc:
        v0 = svc.create_sampling_client(stop_at_end_of_turn=False)
        ptrs = {p.data_ptr() for p in svc.train_model.parameters()}
        assert held(v0._model) == ptrs  # held once
        lora = svc.create_lora_training_client(rank=4)
        lp0 = v0.compute_logprobs(TOKENS).result()
        full = svc.create_training_client()
        assert ptrs.isdisjoint(p.data_ptr() for p in svc.train_model.parameters())
        train_steps(full, 2)
        assert v0.compute_logprobs(TOKENS).result() == lp0
        out = lora.forward([datum(TOKENS)], "cross_entropy").result()  # on the loaded weights
        assert out.loss_fn_outputs[0]["logprobs"] == pytest.approx(lp0[1:], abs=1e-6)
