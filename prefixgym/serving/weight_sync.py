"""RemoteWeightSync: a training client whose published weights go to remote samplers.

Training calls go to the wrapped client. `save_weights_and_get_sampling_client()`
publishes version n (1, 2, ...) under the label "<run token>-<n>":
  1) write the weights where every sampler can read them (a shared filesystem):
     full weights as an HF checkpoint directory `weights_dir/v<n>`; with LoRA, the
     PEFT adapter the training client writes (`write_weights` is given by the caller);
  2) push them to every live server of the pool: full weights through
     `/update_weights_from_disk` (SGLang, prefixgym serve) with `weight_version`
     = label, or vLLM's in-place reload (`OpenAISamplingClient.update_weights_from_disk`); adapters through `/v1/load_lora_adapter` with `lora_name` = label,
     unloading the adapter published `keep_versions` versions before (the K before
     the newest stay loaded for samplers up to K versions behind: --max-staleness K
     keeps K + 1, at least 2). Before its first adapter a process unloads those an
     earlier process of the same run left loaded (a resumed or restarted run; its
     labels differ, so it would never unload them by name): the adapters whose path,
     as /v1/models lists it, lies under `weights_dir`. A server that cannot be reached is marked down and
     the run goes on with the others; a server that *answers* that it cannot load the
     path (not a shared filesystem, a foreign model) stops the run with its message;
  3) wait at `barrier` (torchrun: every rank, after rank 0 pushed), then return the
     pool pinned to the label: its samples come from these weights or are refused.
Only the main rank writes and pushes; every rank returns the same pinned view.
Older weight directories are deleted once `keep_versions` newer ones exist (vLLM
reloads an adapter it evicted from its path).

A server holds one full-weights version at a time, so with full weights a version
must not be pushed while samples of the previous one are still wanted (async
sampling): `prefixgym train` refuses that combination and asks for LoRA.
This module knows the training and sampling protocols and the pool; not the engine.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from prefixgym.futures import APIFuture
from prefixgym.protocols import TrainingClient
from prefixgym.serving.openai_client import OpenAISamplingClient
from prefixgym.serving.pool import PinnedSampler, SamplerPool
from prefixgym.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepOutput

KEEP_VERSIONS = 2
"""The default: the newest version and the one before it (--async)."""


class RemoteWeightSync:
    def __init__(
        self, training: TrainingClient, pool: SamplerPool, weights_dir: str | os.PathLike[str],
        write_weights: Callable[[Path], object], token: str,
        mode: Literal["full", "lora"] = "full", is_main: bool = True,
        barrier: Callable[[], None] | None = None, keep_versions: int = KEEP_VERSIONS,
    ) -> None:
        """`write_weights(dir)` writes the current weights (full: an HF checkpoint; lora:
        a PEFT adapter) into `dir`; `token` makes this run's labels unique (the same on
        every rank); `keep_versions`: the adapters (and directories) kept, the newest
        included."""
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be at least 1, got {keep_versions}")
        self.training = training
        self.pool = pool
        self.weights_dir = Path(weights_dir)
        self.write_weights = write_weights
        self.token = token
        self.mode = mode
        self.is_main = is_main
        self.barrier = barrier
        self.keep_versions = keep_versions
        self.published = 0

    def label(self, version: int) -> str:
        return f"{self.token}-{version}"

    # -- the TrainingClient interface ------------------------------------------------

    def forward_backward(self, datums: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None,
                         ) -> APIFuture[ForwardBackwardOutput]:
        return self.training.forward_backward(datums, loss_fn, loss_fn_config)

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]:
        return self.training.optim_step(adam)

    def save_state(self, path: str | os.PathLike[str],
                   with_optimizer: bool = True) -> APIFuture[str]:
        return self.training.save_state(path, with_optimizer)

    def load_state(self, path: str | os.PathLike[str]) -> APIFuture[int]:
        return self.training.load_state(path)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> PinnedSampler:
        """Steps 1-3 of the module docstring."""
        version = self.published + 1
        label = self.label(version)
        if self.is_main:
            path = self.weights_dir / f"v{version:06d}"
            self.write_weights(path)  # 1)
            self._push(path, label, version)  # 2)
            self._drop_old(version)
        if self.barrier is not None:  # 3)
            self.barrier()
        self.published = version
        return self.pool.pinned(label, version, model=label if self.mode == "lora" else None)

    # -- the steps -------------------------------------------------------------------

    def _push(self, path: Path, label: str, version: int) -> None:
        """2) Every live server loads `path`; unreachable ones are marked down."""
        where = str(path.resolve())
        for server in self.pool.live():
            client = self.pool.clients[server]
            try:
                if self.mode == "full":
                    client.update_weights_from_disk(where, label)
                else:
                    if version == 1:
                        self._unload_leftovers(client)
                    client.load_lora_adapter(label, where)
                    if version > self.keep_versions:
                        client.unload_lora_adapter(self.label(version - self.keep_versions))
            except ValueError as e:  # the server answered: it cannot use these weights
                raise ValueError(f"the sampling server {client.root_url} cannot load the "
                                 f"published weights: {e}") from None
            except (ConnectionError, RuntimeError) as e:
                self.pool.mark_down(server, e)
        if not self.pool.live():
            raise ConnectionError("every sampling server failed; nothing can sample the "
                                  f"published weights ({self.pool.metrics()})")

    def _unload_leftovers(self, client: OpenAISamplingClient) -> None:
        """Unload the adapters an earlier process of this run loaded (step 2)."""
        ours = self.weights_dir.resolve()
        for name, path in client.loaded_adapters().items():
            if path and Path(path).is_relative_to(ours):
                client.unload_lora_adapter(name)

    def _drop_old(self, version: int) -> None:
        old = version - self.keep_versions
        if old >= 1:
            shutil.rmtree(self.weights_dir / f"v{old:06d}", ignore_errors=True)
