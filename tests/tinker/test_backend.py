"""`prefixgym train --backend tinker`, against a strict fake of the hosted service.

The fake takes exactly what tinker's SDK takes: every request is built as the SDK's own
request type (`ForwardBackwardRequest` encoded by the SDK's proto encoder,
`SampleRequest`, `AdamParams`), so a field of the wrong type, a ragged datum or a
loss the service does not know fails here as it would before leaving the SDK. Behind
it, numbers come from the local engine (prefixgym.tinker's full-weight client), and
its cache hits are reported only as `prompt_cache_hit_tokens`. No network.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest

# "tinker.types", not "tinker": without the SDK, this folder itself (tests/tinker/)
# imports as a namespace package called tinker
pytest.importorskip("tinker.types")
from tinker import types as tt  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from prefixgym.cli.train import build_run  # noqa: E402
from prefixgym.tinker import ServiceClient  # noqa: E402
from prefixgym.trainer.config import TrainConfig  # noqa: E402

LOSSES = set(typing.get_args(tt.LossFnType))


def _check_datums(data: object, loss_fn: str, loss_fn_config: object) -> None:
    assert isinstance(data, list) and data, "data must be a non-empty list"
    assert loss_fn in LOSSES, f"unknown loss_fn {loss_fn!r}"
    for datum in data:
        assert isinstance(datum, tt.Datum), type(datum)
        n = datum.model_input.length
        for key, value in datum.loss_fn_inputs.items():
            assert isinstance(value, tt.TensorData), (key, type(value))
            assert value.shape == [n], f"{key}: shape {value.shape}, {n} tokens"
        assert "target_tokens" in datum.loss_fn_inputs
        assert datum.loss_fn_inputs["target_tokens"].dtype == "int64"
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(data=data, loss_fn=loss_fn,
                                                       loss_fn_config=loss_fn_config),
        model_id="fake", seq_id=1)
    forward_backward_request_to_proto(request)  # the SDK's own encoder


class StrictSampler:
    def __init__(self, inner: Any, service: StrictService) -> None:
        self.inner, self.service = inner, service

    def sample(self, prompt: Any, num_samples: int, sampling_params: Any,
               include_prompt_logprobs: bool = False) -> Any:
        tt.SampleRequest(num_samples=num_samples, prompt=prompt, sampling_params=sampling_params,
                         prompt_logprobs=include_prompt_logprobs)  # validates like the SDK
        assert isinstance(prompt, tt.ModelInput) and isinstance(sampling_params,
                                                                tt.SamplingParams)
        future = self.inner.sample(prompt, num_samples, sampling_params,
                                   include_prompt_logprobs=include_prompt_logprobs)
        self.service.hits.append(future.result().prompt_cache_hit_tokens)
        return future

    def compute_logprobs(self, prompt: Any) -> Any:
        assert isinstance(prompt, tt.ModelInput)
        return self.inner.compute_logprobs(prompt)


class StrictTraining:
    def __init__(self, inner: Any, service: StrictService) -> None:
        self.inner, self.service = inner, service

    def forward_backward(self, data: Any, loss_fn: str, loss_fn_config: Any = None) -> Any:
        _check_datums(data, loss_fn, loss_fn_config)
        self.service.losses.append(loss_fn)
        return self.inner.forward_backward(data, loss_fn, loss_fn_config)

    def optim_step(self, optim_params: Any = None, *, adam_params: Any = None) -> Any:
        assert optim_params is None and isinstance(adam_params, tt.AdamParams)
        return self.inner.optim_step(adam_params=adam_params)

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Any:
        assert isinstance(name, str) and name
        local = self.inner.save_state(name).result().path
        remote = f"tinker://fake-run/weights/{name}"
        self.service.states[remote] = local
        return tinker_done(tt.SaveWeightsResponse(path=remote))

    def load_state_with_optimizer(self, path: str) -> Any:
        assert path in self.service.states, f"unknown checkpoint {path}"
        self.inner.load_state_with_optimizer(self.service.states[path]).result()
        return tinker_done(tt.LoadWeightsResponse(path=path))

    def save_weights_and_get_sampling_client(self) -> Any:
        inner = self.inner.save_weights_and_get_sampling_client().result()
        return tinker_done(StrictSampler(inner, self.service))

    def get_tokenizer(self) -> Any:
        return self.inner.get_tokenizer()


class StrictService:
    """tinker's ServiceClient, as far as `--backend tinker` uses it."""

    def __init__(self, local: ServiceClient) -> None:
        self.local = local
        self.hits: list[int] = []
        self.losses: list[str] = []
        self.states: dict[str, str] = {}

    def create_lora_training_client(self, base_model: str, rank: int = 32,
                                    seed: int | None = None) -> Any:
        assert isinstance(base_model, str) and isinstance(rank, int) and rank > 0
        # the fake trains full weights: the protocol, not LoRA, is under test here
        inner = self.local.create_training_client(base_model=base_model, seed=seed).result()
        return tinker_done(StrictTraining(inner, self))


def tinker_done(value: Any) -> Any:
    from prefixgym.tinker.clients import done

    return done(value)


def test_train_runs_on_the_service_and_resumes(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    config = TrainConfig(out=str(tmp_path / "run"), backend="tinker", model="tiny",
                         sft_steps=1, sft_episodes_per_step=2, steps=1, groups_per_step=1,
                         group_size=2, eval_episodes=1, eval_every=5, checkpoint_every=1,
                         max_tokens=4, progress=False)
    with pytest.raises(ValueError, match="TINKER_API_KEY"):
        build_run(config)
    with ServiceClient(checkpoint_dir=tmp_path / "service") as local:
        fake = StrictService(local)
        run, service = build_run(config, tinker_service=fake)
        assert service is None
        result = run.run()
        lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
        grpo = [m for m in lines if m["phase"] == "grpo"]
        assert [m["step"] for m in grpo] == [0]
        # usage from prompt_cache_hit_tokens: the service's hits, all of them
        assert result.usage.prefill_cached_tokens == sum(fake.hits) > 0
        assert result.usage.train_computed_tokens > 0
        assert fake.losses[0] == "cross_entropy"  # the warm start, then GRPO's (if any)
        assert set(fake.losses[1:]) <= {"ppo"} and (tmp_path / "run" / "report.md").exists()
        # resume: the checkpoint names the service's state, which is loaded back
        saved = json.loads(next((tmp_path / "run" / "checkpoints").glob(
            "step-000000/train/tinker.json")).read_text())
        assert saved["path"].startswith("tinker://") and saved["step"] >= 1  # SFT, GRPO
        resumed = TrainConfig(**{**config.__dict__, "steps": 2, "resume": True})
        run, _ = build_run(resumed, tinker_service=fake)
        run.run()
        lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
        assert [m["step"] for m in lines if m["phase"] == "grpo"] == [0, 1]


def test_a_request_the_service_would_refuse_is_refused_by_the_fake() -> None:
    datum = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3]),
                     loss_fn_inputs={"target_tokens": [2, 3]})  # ragged: 2 targets, 3 tokens
    with pytest.raises(AssertionError, match="shape"):
        _check_datums([datum], "cross_entropy", None)
    with pytest.raises(AssertionError, match="unknown loss_fn"):
        _check_datums([datum], "mse", None)
