"""`prefixgym train` beyond one process: ranks under torchrun, samplers on other servers.

Under torchrun (WORLD_SIZE > 1) a run puts each rank on its own device (`run_device`),
joins the process group (NCCL where the ranks train on GPUs, gloo on CPU:
`torchrun_ranks`) and wraps the training client in `DistributedTrainingClient`
(`FSDPTrainingClient` with `--fsdp`: `distribute`). With `--sampler-url`, rollouts and
evaluation sample from OpenAI-compatible servers that receive every published update
(`remote_clients`: a `SamplerPool` behind a `RemoteWeightSync`, LoRA adapters or full
weights). docs/scaling.md tells the whole story. Builds clients only from the service
and config it is handed; knows nothing of envs or of the GRPO loop.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from prefixgym.engine.device import resolve_device
from prefixgym.engine.trainer.training import TrainingClient as LocalTrainingClient
from prefixgym.local_service import LocalService
from prefixgym.protocols import TrainingClient
from prefixgym.rollouts.types import TrajectoryGroup
from prefixgym.serving.config import API_KEY_VARIABLE
from prefixgym.trainer.clients import Clients, Ranks
from prefixgym.trainer.config import TrainConfig
from prefixgym.types import Usage


def run_device(device: str) -> torch.device:
    """`--device` for this process: under torchrun, a GPU named without an index is the
    rank's own (LOCAL_RANK)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return resolve_device(device)
    from prefixgym.engine.trainer.distributed import rank_device

    return rank_device(resolve_device(device))


def torchrun_ranks(service: LocalService) -> Ranks:
    """This process's rank under torchrun (WORLD_SIZE > 1), else the only process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks()
    import torch.distributed as dist

    from prefixgym.engine.trainer.distributed import backend_for, init_distributed

    rank, world = init_distributed(backend_for(service.device))

    def gather(groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        everyone: list[Any] = [None] * world  # all_gather_object fills in unpickled lists
        dist.all_gather_object(everyone, groups)
        for other, theirs in enumerate(everyone):
            if other != rank:  # this rank's ledger counts the whole job, as for training
                service.ledger.add(Usage.total(g.usage for g in theirs))
        return sorted((g for theirs in everyone for g in theirs), key=lambda g: g.seed)

    return Ranks(rank, world, gather, dist.barrier)


def distribute(training: TrainingClient, ranks: Ranks, fsdp: bool
               ) -> tuple[TrainingClient, Ranks]:
    """The training client the ranks share: gradients averaged across them (DDP), or
    with `fsdp` gradients and optimizer state sharded; one process keeps `training`."""
    if ranks.world > 1 and fsdp:
        from prefixgym.engine.trainer.fsdp import FSDPTrainingClient

        sharded: FSDPTrainingClient[Any] = FSDPTrainingClient(training)  # type: ignore[arg-type]
        # the ranks waiting for rank 0's checkpoint help it gather the optimizer's state
        return sharded, dataclasses.replace(ranks, barrier=sharded.barrier)
    if ranks.world > 1:
        from prefixgym.engine.trainer.distributed import DistributedTrainingClient

        return DistributedTrainingClient(training), ranks  # type: ignore[arg-type]
    if fsdp:
        print("--fsdp: one process, nothing to shard (run under torchrun with 2 or more "
              "ranks to shard)", file=sys.stderr)
    return training, ranks


def shared_token(ranks: Ranks) -> str:
    """A label prefix unique to this run, the same on every rank."""
    token = [secrets.token_hex(4)]
    if ranks.world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(token, src=0)
    return token[0]


def unwrap(training: object) -> LocalTrainingClient[Any]:
    """The engine's training client inside the remote-sync and DDP wrappers."""
    while not isinstance(training, LocalTrainingClient):
        training = getattr(training, "training", None) or training.client  # type: ignore[attr-defined]
    return training


def sync_mode(config: TrainConfig) -> Literal["full", "lora"]:
    """How updates reach remote samplers: LoRA adapters for a run with `--lora-rank`,
    else full weights."""
    return "lora" if config.lora_rank else "full"


def weights_writer(mode: str, training: TrainingClient) -> Callable[[Path], object]:
    """What writes one published version: the PEFT adapter (LoRA: the training client's
    `save_weights_for_sampler`, issue 15) or the full model as an HF checkpoint."""
    if mode == "lora":
        inner = unwrap(training)
        return lambda path: inner.save_weights_for_sampler(path).result()
    from prefixgym.engine.model.hf_export import save_hf_checkpoint

    model = training.model  # type: ignore[attr-defined]
    return lambda path: save_hf_checkpoint(model, path)


def remote_clients(config: TrainConfig, service: LocalService, training: TrainingClient,
                   ranks: Ranks) -> Clients:
    """Samplers on `--sampler-url` servers that receive every published update; the
    starting weights are pushed now, so a server that cannot read them fails here."""
    from prefixgym.serving.openai_client import OpenAISamplingClient
    from prefixgym.serving.pool import SamplerPool
    from prefixgym.serving.weight_sync import KEEP_VERSIONS, RemoteWeightSync

    api_key = os.environ.get(API_KEY_VARIABLE) or "EMPTY"
    pool = SamplerPool([OpenAISamplingClient(url, tokenizer=service.tokenizer,
                                             ledger=service.ledger, api_key=api_key)
                        for url in config.sampler_url])
    mode = sync_mode(config)
    sync = RemoteWeightSync(
        training, pool, Path(config.out) / "sampler_weights",
        write_weights=weights_writer(mode, training), token=shared_token(ranks), mode=mode,
        is_main=ranks.is_main, barrier=ranks.barrier,
        keep_versions=max(KEEP_VERSIONS, config.staleness + 1))  # newest + the K behind it
    first = sync.save_weights_and_get_sampling_client()
    return Clients(sync, first, service.tokenizer, service.usage,
                   sampler_metrics=pool.metrics, ranks=ranks, seconds=service.seconds)
