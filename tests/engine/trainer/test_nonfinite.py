"""A non-finite update is never applied: a gradient norm that overflows skips the
update (weights and Adam moments untouched, counted in the metrics) or raises when
asked to; weights that an update made NaN/inf, or so large that a forward overflows,
are never published, saved or sampled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixgym.engine.checkpoint_io import nonfinite_tensor
from prefixgym.engine.model import ModelConfig, Transformer, init_weights
from prefixgym.engine.service import EngineService
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.types import AdamParams, Datum, ModelInput, SamplingParams

CONFIG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     hidden_dim=64, max_seq_len=32)


def make_model() -> Transformer:
    model = Transformer(CONFIG)
    init_weights(model, 0)
    return model


def rl_datum(seq: list[int], advantage: float) -> Datum:
    n = len(seq) - 1
    return Datum(model_input=ModelInput.from_ints(seq[:-1]), loss_fn_inputs={
        "target_tokens": seq[1:], "weights": [1.0] * n, "logprobs": [-1.0] * n,
        "advantages": [advantage] * n})


def batch() -> list[Datum]:
    return [rl_datum([1, 5, 9, 12, 3, 7], 1.0), rl_datum([3, 4, 60, 61], -0.5)]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def adam_state(client: TrainingClient) -> list[torch.Tensor]:
    opt = client._optimizer
    assert opt is not None
    return [t.clone() for s in opt.state.values() for t in s.values()]


def huge_advantage_step(client: TrainingClient) -> None:
    # finite gradients of ~1e20 whose squared norm overflows float32
    client.forward_backward([rl_datum([1, 5, 9, 12, 3, 7], 1e20)], "importance_sampling").result()


def test_an_overflowing_gradient_norm_skips_the_update() -> None:
    client = TrainingClient(make_model())
    client.forward_backward(batch(), "ppo").result()
    client.optim_step(AdamParams(learning_rate=1e-2)).result()  # Adam moments exist
    before_w, before_m = weights(client.model), adam_state(client)
    huge_advantage_step(client)
    out = client.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert out.metrics["grad_norm"] == float("inf")
    assert out.metrics["skipped_nonfinite"] == 1.0 and client.skipped_updates == 1
    assert client.step == 1  # no optimizer step was taken
    assert all(torch.equal(a, b) for a, b in zip(weights(client.model).values(),
                                                  before_w.values()))
    assert all(torch.equal(a, b) for a, b in zip(adam_state(client), before_m))
    assert all(p.grad is None for p in client.model.parameters())  # dropped, not carried
    client.forward_backward(batch(), "ppo").result()
    ok = client.optim_step(AdamParams(learning_rate=1e-2)).result()  # training goes on
    assert ok.metrics["skipped_nonfinite"] == 0.0 and client.step == 2


def test_a_nonfinite_update_can_be_an_error() -> None:
    client = TrainingClient(make_model(), TrainerOptions(nonfinite_update="error"))
    before = weights(client.model)
    huge_advantage_step(client)
    with pytest.raises(ValueError, match="gradient norm is inf"):
        client.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert all(torch.equal(a, b) for a, b in zip(weights(client.model).values(),
                                                  before.values()))
    with pytest.raises(ValueError, match="nonfinite_update"):
        TrainingClient(make_model(), TrainerOptions(nonfinite_update="ignore"))


def test_a_learning_rate_that_overflows_adam_changes_nothing() -> None:
    client = TrainingClient(make_model())
    client.forward_backward(batch(), "ppo").result()
    before = weights(client.model)
    with pytest.raises(ValueError, match="overflows float32"):
        client.optim_step(AdamParams(learning_rate=3e38)).result()
    assert all(torch.equal(a, b) for a, b in zip(weights(client.model).values(),
                                                  before.values()))


def test_weights_an_update_made_nonfinite_are_never_published_or_saved(tmp_path: Path) -> None:
    with EngineService(make_model(), thread_tuning=False) as service:
        client = service.create_training_client()
        client.forward_backward(batch(), "ppo").result()
        with pytest.raises(ValueError, match="left NaN or inf in"):  # norm weights overflow
            client.optim_step(AdamParams(learning_rate=2e38, beta1=0.0,
                                         weight_decay=1.0)).result()
        version = service.weights_version
        with pytest.raises(ValueError, match="not publishing weights"):
            client.save_weights_and_get_sampling_client()
        assert service.weights_version == version
        with pytest.raises(ValueError, match="holds NaN or inf"):
            client.save_state(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt" / "manifest.json").exists()


LARGEST = r"every weight is finite, but a forward of them overflows .* the largest is [\d.]+e\+30, in "


def test_finite_weights_whose_forward_overflows_are_never_published_or_saved(
        tmp_path: Path) -> None:
    # lr=1e30: the update is finite (so applied), every weight near 1e30, and the next
    # forward overflows: nothing could sample from them, so nothing saves them.
    with EngineService(make_model(), thread_tuning=False) as service:
        client = service.create_training_client()
        client.forward_backward(batch(), "ppo").result()
        client.optim_step(AdamParams(learning_rate=1e30)).result()
        assert not nonfinite_tensor(client.model.named_parameters())
        version = service.weights_version
        with pytest.raises(ValueError, match="not publishing weights: " + LARGEST):
            client.save_weights_and_get_sampling_client()
        assert service.weights_version == version
        with pytest.raises(ValueError, match=f"not saving a checkpoint to {tmp_path / 'c'}: "
                                             + LARGEST):
            client.save_state(tmp_path / "c")
        assert not (tmp_path / "c").exists()


def test_lora_adapters_whose_forward_overflows_are_not_saved_for_a_sampler(
        tmp_path: Path) -> None:
    with EngineService(make_model(), thread_tuning=False) as service:
        client = service.create_lora_training_client(rank=2, seed=0)
        client.forward_backward(batch(), "ppo").result()
        ok = client.save_weights_for_sampler(str(tmp_path / "ok")).result()
        assert Path(ok).is_dir()
        client.optim_step(AdamParams(learning_rate=1e30)).result()
        with pytest.raises(ValueError, match=r"not saving weights for a sampler to .*: "
                                             r"every weight is finite, .* in \S+lora_\w+ "):
            client.save_weights_for_sampler(str(tmp_path / "adapter")).result()
        assert not (tmp_path / "adapter").exists()


def test_a_lora_publish_checks_the_adapters_and_refuses_nan_in_them() -> None:
    with EngineService(make_model(), thread_tuning=False) as service:
        client = service.create_lora_training_client(rank=2, seed=0)
        client.forward_backward(batch(), "ppo").result()
        client.optim_step(AdamParams(learning_rate=1e-3)).result()
        first = client.save_weights_and_get_sampling_client()
        assert service.weights_version == first.weights_version
        lora_b = next(p for n, p in client.model.named_parameters()
                      if p.requires_grad and n.endswith("lora_B"))
        with torch.no_grad():
            lora_b.view(-1)[0] = float("nan")
        with pytest.raises(ValueError, match=r"not publishing weights: \S+\.lora_B holds NaN"):
            client.save_weights_and_get_sampling_client()
        assert service.weights_version == first.weights_version


def test_nan_logits_fail_the_request_instead_of_sampling_token_0() -> None:
    model: Transformer = make_model()
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    with EngineService(model, thread_tuning=False) as service:
        sampler = service.create_sampling_client()
        for params in (SamplingParams(max_tokens=3, temperature=0.0),
                       SamplingParams(max_tokens=3, temperature=1.0, seed=0)):
            with pytest.raises(ValueError, match="logits are not finite"):
                sampler.sample([1, 2, 3], num_samples=2, sampling_params=params).result()
        service.check_cache_integrity()
