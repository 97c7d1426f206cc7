"""tinker's `RestClient` over the local training runs (`runs.RunStore`).

    rest = ServiceClient().create_rest_client()
    run = rest.get_training_run_by_tinker_path(state_path).result()
    run.user_metadata["renderer_name"]          # what a resumed cookbook recipe reads

Training runs, their checkpoints (list, delete, publish as a flag) and a checkpoint's
weights info, as the SDK returns them (its types, futures you can `.result()` or
await). A path or run that is not there is a `tinker.TinkerError` (`NotFound`) and a
path not of the `tinker://` form a ValueError, which is what the cookbook catches. The
SDK's other methods (sessions, billing, audit log, copies to other projects) have no
local meaning and raise NotImplementedError naming themselves (`service_client.py`).
Knows the run store and tinker's types; nothing of engines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import tinker
from tinker import types as tt
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from prefixgym.engine.model.config import PRESETS
from prefixgym.tinker.clients import MANIFEST, TrainerKind, done
from prefixgym.tinker.runs import RunStore, parse

Scope = Literal["owned", "accessible"]


class NotFound(tinker.TinkerError, LookupError):
    """No such training run or checkpoint under the checkpoint root."""


class RestClient:
    """tinker's `RestClient` on the runs under one checkpoint root."""

    def __init__(self, runs: RunStore, loaded: Callable[[], dict[str, int]] | None = None,
                 ) -> None:
        self._runs = runs
        self._loaded = loaded or dict
        """The base models loaded now (name -> context length), beyond the presets."""

    def get_server_capabilities(
            self) -> AwaitableConcurrentFuture[tt.GetServerCapabilitiesResponse]:
        """The local engine's models: the built-in presets, and any checkpoint directory
        a client has loaded (any other local checkpoint of a supported family loads too)."""
        models = {**{name: config.max_seq_len for name, config in PRESETS.items()},
                  **self._loaded()}
        return done(tt.GetServerCapabilitiesResponse(supported_models=[
            tt.SupportedModel(model_name=name, max_context_length=length, trainable=True,
                              sampleable=True) for name, length in models.items()]))

    def _found(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except LookupError as e:
            raise NotFound(str(e)) from None

    def get_training_run(self, training_run_id: str, access_scope: Scope = "owned",
                         ) -> AwaitableConcurrentFuture[tt.TrainingRun]:
        return done(self._found(self._runs.training_run, training_run_id))

    def get_training_run_by_tinker_path(self, tinker_path: str, access_scope: Scope = "owned",
                                        ) -> AwaitableConcurrentFuture[tt.TrainingRun]:
        run_id, _, _ = parse(tinker_path)  # ValueError now, as the SDK's
        return self.get_training_run(run_id)

    def get_weights_info_by_tinker_path(
            self, tinker_path: str) -> AwaitableConcurrentFuture[tt.WeightsInfoResponse]:
        directory = self._runs.resolve(tinker_path)
        if not (directory / MANIFEST).exists():
            raise NotFound(f"no checkpoint at {tinker_path}")
        kind = TrainerKind.read(directory)
        return done(tt.WeightsInfoResponse(
            base_model=kind.base_model, is_lora=kind.lora_rank is not None,
            lora_rank=kind.lora_rank, train_unembed=kind.train_unembed,
            train_mlp=kind.train_mlp, train_attn=kind.train_attn))

    def list_training_runs(self, limit: int = 20, offset: int = 0,
                           access_scope: Scope = "owned", project_id: str | None = None,
                           ) -> AwaitableConcurrentFuture[tt.TrainingRunsResponse]:
        ids = self._runs.run_ids()
        page = [self._runs.training_run(i) for i in ids[offset:offset + limit]]
        return done(tt.TrainingRunsResponse(training_runs=page, cursor=tt.Cursor(
            offset=offset, limit=limit, total_count=len(ids))))

    def list_checkpoints(self, training_run_id: str,
                         ) -> AwaitableConcurrentFuture[tt.CheckpointsListResponse]:
        return done(tt.CheckpointsListResponse(
            checkpoints=self._found(self._runs.checkpoints, training_run_id)))

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0,
                              ) -> AwaitableConcurrentFuture[tt.CheckpointsListResponse]:
        every = [c for i in self._runs.run_ids() for c in self._runs.checkpoints(i)]
        every.sort(key=lambda c: c.time, reverse=True)
        return done(tt.CheckpointsListResponse(
            checkpoints=every[offset:offset + limit],
            cursor=tt.Cursor(offset=offset, limit=limit, total_count=len(every))))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str,
                          ) -> AwaitableConcurrentFuture[None]:
        return done(self._found(self._runs.delete, training_run_id, checkpoint_id))

    def delete_checkpoint_from_tinker_path(self, tinker_path: str,
                                           ) -> AwaitableConcurrentFuture[None]:
        run_id, segment, name = parse(tinker_path)
        return self.delete_checkpoint(run_id, f"{segment}/{name}")

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: int | None,
                                            ) -> AwaitableConcurrentFuture[None]:
        """Accepted, and nothing is set: local checkpoints stay until deleted."""
        if not self._runs.resolve(tinker_path).is_dir():
            raise NotFound(f"no checkpoint at {tinker_path}")
        return done(None)

    def get_telemetry(self) -> None:
        """None: nothing is reported anywhere."""
        return None

    def publish_checkpoint_from_tinker_path(self, tinker_path: str,
                                            ) -> AwaitableConcurrentFuture[None]:
        return done(self._found(self._runs.set_public, tinker_path, True))

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str,
                                              ) -> AwaitableConcurrentFuture[None]:
        return done(self._found(self._runs.set_public, tinker_path, False))
