"""tinker's `TrainingClient` and `SamplingClient`, served by the local engine.

Each method takes and returns the `tinker` package's types and futures, converts them
(`convert.py`) and calls the engine's client of the same name. What has no local
meaning is accepted and ignored where harmless (`ttl_seconds`, `retry_config`,
`record_stability_info`: the local trainer and sampler share numerics, so no stability
information is recorded), and refused with `NotImplementedError` naming itself
otherwise (`stubs.py` adds one for every public method of tinker's clients not here).

Each training client is a training run of the `ServiceClient`'s checkpoint root
(`runs.py`); its checkpoints are directories there, named by the `tinker://` paths
the hosted service would return (`tinker://<run id>/weights/<name>`); a method that
takes a path takes such a path or a plain directory. This module knows tinker's
client surface and the engine's clients; not the recipes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from tinker import types as tt
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from prefixgym.engine.sampler.sampling import SamplingClient as EngineSamplingClient
from prefixgym.engine.trainer.training import TrainingClient as EngineTrainingClient
from prefixgym.futures import APIFuture
from prefixgym.tinker import convert
from prefixgym.tinker.runs import RunStore

if TYPE_CHECKING:
    from prefixgym.local_service import LocalService

T = TypeVar("T")
U = TypeVar("U")
MANIFEST = "prefixgym-tinker.json"
"""Beside a saved state: what kind of trainer to rebuild it into (`TrainerKind`)."""


@dataclass(frozen=True)
class TrainerKind:
    """How a training client was made: full weights, or LoRA with these settings."""

    base_model: str
    lora_rank: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    seed: int | None = None

    def write(self, directory: Path) -> None:
        (directory / MANIFEST).write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, directory: Path) -> TrainerKind:
        manifest = directory / MANIFEST
        if not manifest.exists():
            raise FileNotFoundError(f"{directory} is not a state saved by prefixgym.tinker "
                                    f"(no {MANIFEST})")
        return cls(**json.loads(manifest.read_text()))


class ClientFuture(AwaitableConcurrentFuture[T]):
    """A future of a client that is also usable as the client (tinker's backcompat
    futures): attribute access waits for the result."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.result(), name)


def tinker_future(ours: APIFuture[T], fn: Callable[[T], U]) -> AwaitableConcurrentFuture[U]:
    """Our future, mapped through `fn`, as a tinker future."""
    return AwaitableConcurrentFuture(ours.map(fn).future())


def done(value: T) -> AwaitableConcurrentFuture[T]:
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_result(value)
    return AwaitableConcurrentFuture(future)


class SamplingClient:
    """tinker's `SamplingClient` on one weights version of the local engine."""

    def __init__(self, engine: EngineSamplingClient, service: LocalService,
                 base_model: str) -> None:
        self._engine = engine
        self._service = service
        self._base_model = base_model

    def sample(
        self, prompt: tt.ModelInput, num_samples: int, sampling_params: tt.SamplingParams,
        include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0, target_prompt_logprobs: tt.TensorData | None = None,
        prompt_alt_tokens_k: int = 0, prompt_logprobs_last_n: int | None = None,
    ) -> AwaitableConcurrentFuture[tt.SampleResponse]:
        for name, value in (("topk_sample_logprobs", topk_sample_logprobs),
                            ("target_prompt_logprobs", target_prompt_logprobs),
                            ("prompt_alt_tokens_k", prompt_alt_tokens_k)):
            if value:
                raise NotImplementedError(f"SamplingClient.sample({name}=...) is not supported "
                                          "by prefixgym.tinker")
        ids = convert.token_ids(prompt, "prompt")
        params = convert.to_sampling_params(sampling_params, len(ids), self._service.max_seq_len,
                                            self._service.end_of_turn_ids)
        ours = self._engine.sample(ids, num_samples=num_samples, sampling_params=params,
                                   include_prompt_logprobs=include_prompt_logprobs,
                                   topk_prompt_logprobs=topk_prompt_logprobs,
                                   prompt_logprobs_last_n=prompt_logprobs_last_n)
        return tinker_future(ours, convert.to_tinker_sample_response)

    def compute_logprobs(self, prompt: tt.ModelInput, prompt_logprobs_last_n: int | None = None,
                         ) -> AwaitableConcurrentFuture[list[float | None]]:
        ids = convert.token_ids(prompt, "prompt")
        ours = self._engine.sample(ids, num_samples=1,
                                   sampling_params=convert.SamplingParams(max_tokens=0),
                                   include_prompt_logprobs=True,
                                   prompt_logprobs_last_n=prompt_logprobs_last_n)
        return tinker_future(ours, lambda r: list(r.prompt_logprobs or []))

    def get_tokenizer(self) -> Any:
        return self._service.tokenizer

    def get_base_model(self) -> str:
        return self._base_model


class TrainingClient:
    """tinker's `TrainingClient` on an engine training client (full weights or LoRA)."""

    def __init__(self, engine: EngineTrainingClient[EngineSamplingClient],
                 service: LocalService, kind: TrainerKind, runs: RunStore, run_id: str) -> None:
        self._engine = engine
        self._service = service
        self._kind = kind
        self._runs = runs
        self.model_id = run_id
        """The training run's id, as the SDK's `TrainingClient.model_id`."""

    # -- training ----------------------------------------------------------------------

    def forward_backward(self, data: Sequence[tt.Datum], loss_fn: str,
                         loss_fn_config: dict[str, float] | None = None,
                         ) -> AwaitableConcurrentFuture[tt.ForwardBackwardOutput]:
        datums = [convert.to_datum(d, i) for i, d in enumerate(data)]
        ours = self._engine.forward_backward(datums, loss_fn, loss_fn_config)
        return tinker_future(ours, convert.to_tinker_forward_backward)

    def forward(self, data: Sequence[tt.Datum], loss_fn: str,
                loss_fn_config: dict[str, float] | None = None,
                ) -> AwaitableConcurrentFuture[tt.ForwardBackwardOutput]:
        datums = [convert.to_datum(d, i) for i, d in enumerate(data)]
        ours = self._engine.forward(datums, loss_fn, loss_fn_config)
        return tinker_future(ours, convert.to_tinker_forward_backward)

    def forward_backward_custom(
        self, data: Sequence[tt.Datum],
        loss_fn: Callable[[list[tt.Datum], list[torch.Tensor]], Any],
        *, loss_type_input: str | None = None,
    ) -> AwaitableConcurrentFuture[tt.ForwardBackwardOutput]:
        if not callable(loss_fn):
            raise NotImplementedError("forward_backward_custom takes a callable loss here; "
                                      "a server-side LossHandle is not supported")
        originals = list(data)
        datums = [convert.to_datum(d, i) for i, d in enumerate(originals)]
        ours = self._engine.forward_backward_custom(
            datums, lambda _datums, logprobs: loss_fn(originals, logprobs))
        return tinker_future(ours, convert.to_tinker_forward_backward)

    def optim_step(self, optim_params: tt.AdamParams | None = None, *,
                   adam_params: tt.AdamParams | None = None,
                   ) -> AwaitableConcurrentFuture[tt.OptimStepResponse]:
        params = adam_params if adam_params is not None else optim_params
        if params is None:
            raise ValueError("optim_step needs adam_params")
        ours = self._engine.optim_step(convert.to_adam(params))
        return tinker_future(ours, lambda out: tt.OptimStepResponse(metrics=dict(out.metrics)))

    # -- state -------------------------------------------------------------------------

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None,
                   ) -> AwaitableConcurrentFuture[tt.SaveWeightsResponse]:
        path = self._runs.checkpoint_dir(self.model_id, "weights", name)
        if path.exists() and not overwrite and any(path.iterdir()):
            raise ValueError(f"a state named {name!r} exists ({path}); pass overwrite=True")
        path.mkdir(parents=True, exist_ok=True)
        self._engine.save_state(path).result()
        self._kind.write(path)
        return done(tt.SaveWeightsResponse(path=self._runs.path_of(self.model_id, "weights",
                                                                   name)))

    def load_state(self, path: str, weights_access_token: str | None = None,
                   ) -> AwaitableConcurrentFuture[tt.LoadWeightsResponse]:
        """Weights only; the optimizer starts afresh (as the hosted service's)."""
        self._engine.load_state(self._runs.resolve(path), with_optimizer=False).result()
        return done(tt.LoadWeightsResponse(path=path))

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None,
                                  ) -> AwaitableConcurrentFuture[tt.LoadWeightsResponse]:
        self._engine.load_state(self._runs.resolve(path)).result()
        return done(tt.LoadWeightsResponse(path=path))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None,
                                 ) -> AwaitableConcurrentFuture[tt.SaveWeightsForSamplerResponse]:
        save = getattr(self._engine, "save_weights_for_sampler", None)
        if save is None:
            raise NotImplementedError("TrainingClient.save_weights_for_sampler needs a LoRA "
                                      "training client (create_lora_training_client)")
        path = self._runs.checkpoint_dir(self.model_id, "sampler_weights", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = save(str(path))
        saved = Path(str(saved.result() if hasattr(saved, "result") else saved or path))
        self._kind.write(saved)
        return done(tt.SaveWeightsForSamplerResponse(
            path=self._runs.path_of(self.model_id, "sampler_weights", name)))

    # -- sampling ----------------------------------------------------------------------

    def save_weights_and_get_sampling_client(
        self, name: str | None = None, retry_config: object = None,
        record_stability_info: bool = False, kind: str = "snapshot",
    ) -> ClientFuture[SamplingClient]:
        if kind != "snapshot":
            raise NotImplementedError(f"save_weights_and_get_sampling_client(kind={kind!r}) is "
                                      "not supported by prefixgym.tinker (only 'snapshot')")
        engine = self._engine.save_weights_and_get_sampling_client()
        client = SamplingClient(_without_default_stops(engine), self._service,
                                self._kind.base_model)
        return ClientFuture(done(client).future())

    def create_sampling_client(self, model_path: str, retry_config: object = None,
                               record_stability_info: bool = False,
                               ) -> ClientFuture[SamplingClient]:
        return ClientFuture(done(sampling_client_from_path(
            self._service, self._runs.resolve(model_path), self._kind.base_model)).future())

    # -- information -------------------------------------------------------------------

    def get_info(self) -> tt.GetInfoResponse:
        return tt.GetInfoResponse(
            model_data=tt.ModelData(model_name=self._kind.base_model,
                                    tokenizer_id=self._kind.base_model),
            model_id=self.model_id, is_lora=self._kind.lora_rank is not None,
            lora_rank=self._kind.lora_rank, model_name=self._kind.base_model)

    def get_tokenizer(self) -> Any:
        return self._service.tokenizer

    def get_telemetry(self) -> None:
        return None


def sampling_client_from_path(service: LocalService, model_path: str | os.PathLike[str],
                              base_model: str) -> SamplingClient:
    """A sampling client of weights saved by `save_weights_for_sampler` (LoRA)."""
    engine = service.create_sampling_client(stop_at_end_of_turn=False,
                                            model_path=os.fspath(model_path))
    return SamplingClient(engine, service, base_model)


def _without_default_stops(engine: EngineSamplingClient) -> EngineSamplingClient:
    """The tinker client decides the stops itself (`convert.to_sampling_params`)."""
    engine.default_stop_token_ids = ()
    return engine
