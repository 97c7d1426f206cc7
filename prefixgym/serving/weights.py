"""Which weights `prefixgym serve` samples from, and the routes that change them.

The routes are SGLang's and vLLM's names and bodies, so one trainer-side client
drives all three servers:
  POST /update_weights_from_disk  {"model_path", "weight_version"?}  (SGLang)
       -> {"success", "message", "num_paused_requests"}; 400 with success false when
       the directory cannot be read or does not fit the served model;
  GET  /get_weight_version        -> {"weight_version"}  (SGLang)
  POST /v1/load_lora_adapter      {"lora_name", "lora_path"}  (vLLM; SGLang's
       /load_lora_adapter is the same route) -> 200 "Success: ..." text;
  POST /v1/unload_lora_adapter    {"lora_name"}  (vLLM; SGLang: /unload_lora_adapter).
Every completion names the weights that produced it in `metadata.weight_version`
(SGLang's field): the label the last update gave (SGLang's default is "default"),
or for a request with `model=<lora_name>` that adapter's name, as vLLM echoes it in
`model`.

Full weights come from a Hugging Face checkpoint directory (`engine.hf_export`
writes one) that this server must be able to read: trainer and samplers share a
filesystem, and a path the server cannot read is a 400 naming the path and the host.
A request already running finishes on the weights it started with (the engine pins a
frozen copy per version) and reports that version.

Adapters: `load_adapter` asks the engine service for a sampling client of the base
model plus the PEFT adapter at `lora_path` (`create_sampling_client(model_path=...)`).
This module knows the engine service's public interface and the HF checkpoint
reader; it knows nothing of training or of the completions format.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from prefixgym.engine.model.hf_checkpoint import load_hf_checkpoint
from prefixgym.engine.sampler.sampling import SamplingClient
from prefixgym.engine.service import EngineService
from prefixgym.serving.bodies import BodyError, parse_json_object, read_body
from prefixgym.types import JSONObject

DEFAULT_LABEL = "default"


class WeightsError(Exception):
    """A weights request that cannot be served: HTTP `status`, one-line `message`."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class _Adapter:
    path: str
    sampler: SamplingClient


class ServedWeights:
    """The served base weights (a label per engine version) and the loaded adapters."""

    def __init__(self, service: EngineService, model_name: str) -> None:
        self.service = service
        self.model_name = model_name
        self._lock = threading.Lock()
        self._labels: dict[int, str] = {service.weights_version: DEFAULT_LABEL}
        self._adapters: dict[str, _Adapter] = {}

    @property
    def label(self) -> str:
        """The label of the newest base weights."""
        with self._lock:
            return self._labels[max(self._labels)]

    @property
    def adapter_paths(self) -> dict[str, str]:
        """Each loaded adapter's name -> the path it was loaded from, in load order."""
        with self._lock:
            return {name: adapter.path for name, adapter in self._adapters.items()}

    def serves(self, model: str | None) -> bool:
        with self._lock:
            return model is None or model == self.model_name or model in self._adapters

    def sampler_for(self, model: str | None, stop_at_end_of_turn: bool
                    ) -> tuple[SamplingClient, str]:
        """A sampling client for `model` (None: the base) and the label of its weights."""
        with self._lock:
            adapter = self._adapters.get(model) if model is not None else None
            if adapter is not None:
                return adapter.sampler, str(model)
            sampler = self.service.create_sampling_client(stop_at_end_of_turn)
            return sampler, self._labels.get(sampler.weights_version, DEFAULT_LABEL)

    # -- full weights --------------------------------------------------------------

    def update_from_disk(self, model_path: str, label: str | None) -> str:
        """Load the HF checkpoint at `model_path` as the new base weights; returns its label."""
        directory = readable_directory(model_path, "model_path")
        try:
            loaded = load_hf_checkpoint(directory,
                                        max_seq_len=self.service.train_model.config.max_seq_len)
        except (OSError, ValueError) as e:
            raise WeightsError(400, f"cannot load weights from {model_path} on "
                                    f"{socket.gethostname()}: {e}", "model_path") from None
        target = self.service.train_model
        if loaded.config != target.config:
            raise WeightsError(400, f"the checkpoint at {model_path} is a different model "
                                    f"({loaded.config}) from the one served ({target.config})",
                               "model_path")
        new = dict(loaded.named_parameters())
        with self._lock, torch.no_grad():
            for name, param in target.named_parameters():
                # new storage, not an in-place copy: a published version that shares the
                # old tensors (and requests running on it) keeps them
                param.data = new[name].detach().to(param.dtype)
            self.service.publish_weights()
            version = self.service.weights_version
            self._labels[version] = label if label is not None else str(version)
            return self._labels[version]

    # -- adapters (LoRA) ----------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        """Serve `model=name` from the base weights plus the PEFT adapter at `path`."""
        if not name:
            raise WeightsError(400, "lora_name must not be empty", "lora_name")
        if name == self.model_name:
            raise WeightsError(400, f"lora_name {name!r} is the base model's name", "lora_name")
        directory = readable_directory(path, "lora_path")
        with self._lock:
            if name in self._adapters:
                raise WeightsError(400, f"the LoRA adapter {name!r} is already loaded; "
                                        "unload it first", "lora_name")
        try:
            sampler = self.service.create_sampling_client(model_path=str(directory))
        except (OSError, ValueError) as e:
            raise WeightsError(400, f"cannot load the LoRA adapter at {path}: {e}",
                               "lora_path") from None
        with self._lock:
            self._adapters[name] = _Adapter(str(directory), sampler)

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise WeightsError(404, f"no LoRA adapter named {name!r} is loaded", "lora_name")


def readable_directory(path: str, param: str) -> Path:
    """`path` as a directory this process can list, or a 400 saying why not."""
    host = socket.gethostname()
    if not isinstance(path, str) or not path:
        raise WeightsError(400, f"{param} must be a non-empty path", param)
    directory = Path(path)
    try:
        if not directory.exists():
            raise WeightsError(400, f"{param} {path} does not exist on the sampling server "
                                    f"({host}); the trainer and the samplers must share a "
                                    "filesystem", param)
        if not directory.is_dir():
            raise WeightsError(400, f"{param} {path} is not a directory", param)
        next(directory.iterdir(), None)
    except PermissionError:
        raise WeightsError(400, f"the sampling server ({host}) may not read {param} "
                                f"{path}", param) from None
    return directory


def add_weight_routes(app: FastAPI, weights: ServedWeights,
                      authorize: Callable[[Request], None], max_body_bytes: int) -> None:
    """The routes of the module docstring, on `app`; each first calls `authorize`
    (the app's API-key check), so no one without the key changes what is served.
    Bodies are read as every route reads them (`bodies.py`: 415, 413, 400)."""

    async def body_of(request: Request) -> JSONObject:
        try:
            return parse_json_object(await read_body(request, max_body_bytes))
        except BodyError as e:
            raise WeightsError(e.status, e.message) from None

    def text_field(body: JSONObject, key: str, required: bool = True) -> str | None:
        value = body.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise WeightsError(400, f"{key} must be a non-empty string", key)
        return value

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        authorize(request)
        try:
            body = await body_of(request)
            path = text_field(body, "model_path")
            label = text_field(body, "weight_version", required=False)
            assert path is not None
            label = await run_in_threadpool(weights.update_from_disk, path, label)
        except WeightsError as e:
            return JSONResponse({"success": False, "message": e.message,
                                 "num_paused_requests": 0}, e.status)
        return JSONResponse({"success": True, "num_paused_requests": 0,
                             "message": f"Succeeded to update model weights. Weight version "
                                        f"updated to {label}."})

    @app.get("/get_weight_version")
    async def get_weight_version(request: Request) -> JSONObject:
        authorize(request)
        return {"weight_version": weights.label}

    @app.post("/v1/load_lora_adapter")
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        authorize(request)
        body = await body_of(request)
        name, path = text_field(body, "lora_name"), text_field(body, "lora_path")
        assert name is not None and path is not None
        await run_in_threadpool(weights.load_adapter, name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        authorize(request)
        name = text_field(await body_of(request), "lora_name")
        assert name is not None
        weights.unload_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
