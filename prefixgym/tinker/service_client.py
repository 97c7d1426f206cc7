"""`ServiceClient`: tinker's entry point, with the local engine behind it.

    from prefixgym.tinker import ServiceClient     # instead of tinker.ServiceClient
    service_client = ServiceClient()
    training_client = service_client.create_lora_training_client(base_model="tiny").result()

`base_model` is a built-in preset name or a local Hugging Face checkpoint directory;
one `LocalService` per base model is built on first use (or pass `service=`). The
constructor takes tinker's arguments (`base_url`, `api_key`, ... are accepted and
unused: nothing leaves the machine; `user_metadata` goes to every training run it
makes) and prefixgym's: `service`, `seed`, and `checkpoint_dir` (the checkpoint root:
the training runs and their checkpoints, `runs.py`; default `$PREFIXGYM_TINKER_DIR` or
`~/.cache/prefixgym/tinker`). Saved paths are `tinker://` paths, resolved under the
root; `create_rest_client()` reads the runs (`rest_client.py`).

Also here: the `*_async` variant of every method (as tinker has them), and a
`NotImplementedError` naming itself for every public method of tinker's three clients
that has no local counterpart. This module knows tinker's client surface and
LocalService; conversions are `convert.py`'s, the clients `clients.py`'s.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tinker

from prefixgym.local_service import LocalService
from prefixgym.tinker.clients import (
    ClientFuture,
    SamplingClient,
    TrainerKind,
    TrainingClient,
    done,
    sampling_client_from_path,
)
from prefixgym.tinker.rest_client import RestClient
from prefixgym.tinker.runs import RunStore


class ServiceClient:
    """tinker's `ServiceClient` on the local engine (see the module docstring)."""

    def __init__(self, user_metadata: dict[str, str] | None = None,
                 project_id: str | None = None, *, display_name: str | None = None,
                 base_url: str | None = None, api_key: str | None = None,
                 default_headers_overrides: Any = None, service: LocalService | None = None,
                 seed: int = 0, checkpoint_dir: str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        self._services: dict[str, LocalService] = {}
        self._given_service = service
        self._seed = seed
        self._user_metadata = dict(user_metadata or {})
        root = checkpoint_dir or os.environ.get("PREFIXGYM_TINKER_DIR") or (
            Path.home() / ".cache" / "prefixgym" / "tinker")
        self._runs = RunStore(root)

    def service(self, base_model: str) -> LocalService:
        """The LocalService of `base_model` (the given one, if any)."""
        if self._given_service is not None:
            return self._given_service
        if base_model not in self._services:
            self._services[base_model] = LocalService(model=base_model, seed=self._seed)
        return self._services[base_model]

    # -- training clients ---------------------------------------------------------------

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, train_mlp: bool = True,
        train_attn: bool = True, train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None, optimizer: object = None,
    ) -> ClientFuture[TrainingClient]:
        kind = TrainerKind(base_model, rank, train_mlp, train_attn, train_unembed, seed)
        return ClientFuture(done(self._build(kind, user_metadata)).future())

    def create_training_client(self, base_model: str, seed: int | None = None,
                               user_metadata: dict[str, str] | None = None,
                               ) -> ClientFuture[TrainingClient]:
        """prefixgym's addition (tinker has LoRA clients only): full-weight training."""
        return ClientFuture(done(self._build(TrainerKind(base_model, seed=seed),
                                             user_metadata)).future())

    def create_training_client_from_state(
        self, path: str, base_model: str | None = None,
        user_metadata: dict[str, str] | None = None, weights_access_token: str | None = None,
        optimizer: object = None,
    ) -> ClientFuture[TrainingClient]:
        """A new run, of the saved kind, with the saved weights (optimizer afresh)."""
        client = self._build(TrainerKind.read(self._runs.resolve(path)), user_metadata)
        client.load_state(path).result()
        return ClientFuture(done(client).future())

    def create_training_client_from_state_with_optimizer(
        self, path: str, base_model: str | None = None,
        user_metadata: dict[str, str] | None = None, weights_access_token: str | None = None,
    ) -> ClientFuture[TrainingClient]:
        client = self._build(TrainerKind.read(self._runs.resolve(path)), user_metadata)
        client.load_state_with_optimizer(path).result()
        return ClientFuture(done(client).future())

    def _build(self, kind: TrainerKind, user_metadata: dict[str, str] | None = None,
               ) -> TrainingClient:
        """A training client of `kind`: a new training run under the checkpoint root."""
        service = self.service(kind.base_model)
        if kind.lora_rank is None:
            engine = service.create_training_client()
        else:
            engine = service.create_lora_training_client(
                rank=kind.lora_rank, train_attn=kind.train_attn, train_mlp=kind.train_mlp,
                train_unembed=kind.train_unembed, seed=kind.seed)
        run_id = self._runs.new_run(kind.base_model, kind.lora_rank,
                                    {**self._user_metadata, **(user_metadata or {})})
        return TrainingClient(engine, service, kind, self._runs, run_id)

    # -- sampling clients ---------------------------------------------------------------

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None, retry_config: object = None,
                               record_stability_info: bool = False,
                               ) -> ClientFuture[SamplingClient]:
        if model_path is not None:
            directory = self._runs.resolve(model_path)
            kind = TrainerKind.read(directory) if base_model is None else None
            model = base_model or (kind.base_model if kind else "")
            client = sampling_client_from_path(self.service(model), directory, model)
        elif base_model is not None:
            service = self.service(base_model)
            client = SamplingClient(service.create_sampling_client(stop_at_end_of_turn=False),
                                    service, base_model)
        else:
            raise ValueError("create_sampling_client needs model_path or base_model")
        return ClientFuture(done(client).future())

    def create_rest_client(self) -> RestClient:
        """The training runs and checkpoints under this client's checkpoint root."""
        return RestClient(self._runs, lambda: {
            name: service.train_model.config.max_seq_len
            for name, service in self._services.items()})

    def get_telemetry(self) -> None:
        """None: nothing is reported anywhere (so the clients made here have none)."""
        return None

    def get_server_capabilities(self) -> Any:
        return self.create_rest_client().get_server_capabilities().result()

    # -- the rest ---------------------------------------------------------------------

    def close(self, status: str = "success", detail: str | None = None) -> Any:
        for service in self._services.values():
            service.close()
        self._services.clear()
        return done(None)

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Methods whose tinker `_async` variant returns the resolved value, not a future.
_RESOLVED_ASYNC = {"create_lora_training_client", "create_sampling_client",
                   "create_training_client_from_state",
                   "create_training_client_from_state_with_optimizer",
                   "save_weights_and_get_sampling_client", "sample", "compute_logprobs"}


def _async_variant(name: str) -> Callable[..., Any]:
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self, name)(*args, **kwargs)
        return await result if name in _RESOLVED_ASYNC else result

    method.__name__ = f"{name}_async"
    return method


def _not_supported(cls_name: str, name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{cls_name}.{name} is not supported by prefixgym.tinker "
                                  "(the local engine has no counterpart)")

    method.__name__ = name
    return method


def _complete(ours: type, theirs: type) -> None:
    """Give `ours` an `_async` variant of each of its methods and a NotImplementedError
    for every other public method of tinker's class of the same name."""
    for name, member in list(vars(ours).items()):
        if callable(member) and not name.startswith("_") and not name.endswith("_async") \
                and hasattr(theirs, f"{name}_async") and f"{name}_async" not in vars(ours):
            setattr(ours, f"{name}_async", _async_variant(name))
    for name, member in inspect.getmembers(theirs):
        if not name.startswith("_") and callable(member) and not hasattr(ours, name):
            setattr(ours, name, _not_supported(theirs.__name__, name))


_complete(ServiceClient, tinker.ServiceClient)
_complete(TrainingClient, tinker.TrainingClient)
_complete(SamplingClient, tinker.SamplingClient)
_complete(RestClient, tinker.RestClient)
