"""Data-parallel training under `torchrun`: one TrainingClient per rank, summed gradients.

`DistributedTrainingClient` wraps a rank's `TrainingClient` and keeps the single-
process meaning of every call: `forward_backward(datums)` on W ranks leaves the same
accumulated gradients as one process would (the losses are sums, so the gradient of
the whole batch is the sum of the ranks' gradients), and `optim_step` then gives
every rank the same weights. Each rank is given the *same* list of datums; it trains
on its shard: with shared prefixes (the client's `share_prefixes`), a run of the
datums in prefix-trie order with about 1/W of the distinct positions
(`prefix_trie.shard_by_prefix`), so the datums that share a prefix share it on one
rank; without, `datums[rank::W]`. One `forward_backward`:
  1) validate the whole request on every rank -- the same verdict everywhere, before
     any collective, so a bad datum raises on all ranks and changes nothing;
  2) set this rank's accumulated gradients aside and run its shard;
  3) all-gather the ranks' outcomes (outputs, or the error of a rank whose loss was
     not finite); on any error, every rank drops the new gradients and raises;
  4) all-reduce (sum) the new gradients, in one flat buffer per dtype, and add them
     back to the accumulated ones;
  5) return the merged output: per-datum logprobs in the caller's order, summed
     loss, token counts and usage (also added to this rank's ledger, so rank 0's
     ledger reports the whole job).
Only rank 0 writes checkpoints (`save_state`); `is_main` tells the caller which rank
reports. Calls block until done (the returned futures are complete) and must be made
in the same order on every rank, as with any collective. Backends: gloo on CPU, NCCL
on GPU (`init_distributed` picks). This module knows nothing of envs or samplers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Generic

import torch
import torch.distributed as dist

from prefixgym.engine.trainer.prefix_trie import shard_by_prefix
from prefixgym.engine.trainer.training import SamplerT, TrainingClient
from prefixgym.futures import APIFuture
from prefixgym.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    JSONObject,
    OptimStepOutput,
    Usage,
)

_SUMMED_METRICS = ("loss:sum", "loss", "train_computed_tokens", "train_loss_tokens", "train_shared_tokens")


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (env://); returns (rank, world_size).

    `backend=None` picks NCCL when CUDA is available (and sets this process's device to
    LOCAL_RANK), gloo otherwise. A group that already exists is reused.
    """
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def rank_device(device: torch.device) -> torch.device:
    """This torchrun rank's device: a CUDA device named without an index is the rank's
    own GPU (LOCAL_RANK), so N ranks on one machine use N GPUs; anything else as given."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def backend_for(device: torch.device) -> str:
    """The process group's backend for ranks that train on `device`: NCCL on CUDA,
    gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


class RankClient:
    """What both torchrun wrappers (this module's, `fsdp.py`'s) share: rank 0 leads,
    and `forward_backward` and `forward` are one request the subclass runs on every
    rank (`_request`)."""

    rank: int

    @property
    def is_main(self) -> bool:
        """Whether this rank writes checkpoints, logs and reports."""
        return self.rank == 0

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None,
                         ) -> APIFuture[ForwardBackwardOutput]:
        return APIFuture.completed(self._request(data, loss_fn, loss_fn_config, backward=True))

    def forward(self, data: Sequence[Datum], loss_fn: str,
                loss_fn_config: Mapping[str, float] | None = None,
                ) -> APIFuture[ForwardBackwardOutput]:
        """`forward_backward` without gradients, sharded the same way."""
        return APIFuture.completed(self._request(data, loss_fn, loss_fn_config, backward=False))

    def _request(self, datums: Sequence[Datum], loss_fn: str,
                 loss_fn_config: Mapping[str, float] | None, backward: bool,
                 ) -> ForwardBackwardOutput:
        raise NotImplementedError


class DistributedTrainingClient(RankClient, Generic[SamplerT]):
    """Data parallelism over an initialised process group; see the module docstring."""

    def __init__(self, client: TrainingClient[SamplerT], group: dist.ProcessGroup | None = None,
                 broadcast_weights: bool = True) -> None:
        if not dist.is_initialized():
            raise RuntimeError("no process group: call init_distributed() (under torchrun) first")
        self.client = client
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if broadcast_weights:  # every rank starts from rank 0's weights, as DDP does
            self._broadcast_parameters()

    @property
    def model(self) -> torch.nn.Module:
        return self.client.model

    @property
    def step(self) -> int:
        return self.client.step

    # -- requests ------------------------------------------------------------------

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]:
        """The same AdamW step on every rank (their gradients are equal)."""
        return APIFuture.completed(self.client.optim_step(adam).result())

    def save_state(self, path: str | os.PathLike[str],
                   with_optimizer: bool = True) -> APIFuture[str]:
        """Rank 0 writes the checkpoint; the others wait for it."""
        if self.is_main:
            self.client.save_state(path, with_optimizer)
        dist.barrier(group=self.group)
        return APIFuture.completed(os.fspath(path))

    def load_state(self, path: str | os.PathLike[str]) -> APIFuture[int]:
        """Every rank reads `path` (a filesystem all ranks see); weights then come from rank 0."""
        step = self.client.load_state(path).result()
        self._broadcast_parameters()
        return APIFuture.completed(step)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplerT:
        """Publish this rank's (identical) weights to its own local sampler."""
        return self.client.save_weights_and_get_sampling_client(name)

    # -- the steps ------------------------------------------------------------------

    def _request(self, datums: Sequence[Datum], loss_fn: str,
                 loss_fn_config: Mapping[str, float] | None, backward: bool,
                 ) -> ForwardBackwardOutput:
        # 1) the same validation on every rank
        prepared, _, _ = self.client._validate(datums, loss_fn, loss_fn_config)
        shards = self.shards([p.tokens_T.tolist() for p in prepared])
        indices = shards[self.rank]
        params = [p for p in self.client.model.parameters() if p.requires_grad]
        # 2) this rank's shard, with the accumulated gradients set aside
        saved = [p.grad for p in params]
        if backward:
            for p in params:
                p.grad = None
        outcome: tuple[str, JSONObject | str | None]
        try:
            if indices:
                run = self.client.forward_backward if backward else self.client.forward
                out = run([datums[i] for i in indices], loss_fn, loss_fn_config).result()
                outcome = ("ok", out.model_dump())
            else:
                outcome = ("ok", None)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or they hang
            outcome = ("error", f"{type(e).__name__}: {e}")
        has_grad = [p.grad is not None for p in params]
        # 3) everyone's outcome
        gathered: list[Any] = [None] * self.world_size  # all_gather_object puts unpickled objects
        dist.all_gather_object(gathered, (outcome, has_grad), group=self.group)
        errors = [(r, o[1]) for r, (o, _) in enumerate(gathered) if o[0] == "error"]
        if errors:
            for p, g in zip(params, saved):
                p.grad = g
            rank, message = errors[0]
            raise ValueError(f"forward_backward failed on rank {rank} (gradients left "
                             f"unchanged on every rank): {message}")
        # 4) summed gradients, added to the accumulated ones
        if backward:
            any_grad = [any(flags[k] for _, flags in gathered) for k in range(len(params))]
            self._all_reduce_grads(params, any_grad)
            for p, g in zip(params, saved):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
        # 5) the merged output
        outputs = [(r, ForwardBackwardOutput.model_validate(o[1]))
                   for r, (o, _) in enumerate(gathered) if o[1] is not None]
        merged = merge_rank_outputs(outputs, shards, len(datums))
        others = sum((out.usage for r, out in outputs if r != self.rank), Usage())
        self.client.ledger.add(others)
        return merged

    def shards(self, tokens: list[list[int]]) -> list[list[int]]:
        """Which datums (given by their input tokens) each rank trains, in its order."""
        if self.client.options.share_prefixes:
            return shard_by_prefix(tokens, self.world_size)
        return [list(range(r, len(tokens), self.world_size)) for r in range(self.world_size)]

    def _all_reduce_grads(self, params: list[torch.nn.Parameter], any_grad: list[bool]) -> None:
        buckets: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p, needed in zip(params, any_grad):
            if needed:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                buckets.setdefault((p.dtype, p.device), []).append(p)
        for group in buckets.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])  # type: ignore[union-attr]
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            at = 0
            for p in group:
                n = p.numel()
                p.grad.copy_(flat[at:at + n].view_as(p))  # type: ignore[union-attr]
                at += n

    def _broadcast_parameters(self) -> None:
        broadcast_parameters(self.client.model, self.group)


def broadcast_parameters(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Give every rank of `group` the first rank's parameters, in place."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=src, group=group)


def merge_rank_outputs(outputs: list[tuple[int, ForwardBackwardOutput]], shards: list[list[int]],
           n: int) -> ForwardBackwardOutput:
    """The single-process output: rank r's j-th datum is datum shards[r][j]."""
    loss_fn_outputs: list[dict[str, list[float]]] = [{} for _ in range(n)]
    usage = Usage()
    sums: dict[str, float] = {}
    for rank, out in outputs:
        for j, item in enumerate(out.loss_fn_outputs):
            loss_fn_outputs[shards[rank][j]] = item
        usage = usage + out.usage
        n_loss_local = max(out.usage.train_loss_tokens, 1)
        for key, value in out.metrics.items():
            # summed metrics add up; per-loss-token means are re-weighted by their tokens
            weight = 1.0 if key in _SUMMED_METRICS else n_loss_local
            sums[key] = sums.get(key, 0.0) + value * weight
    n_loss = max(usage.train_loss_tokens, 1)
    metrics = {k: v if k in _SUMMED_METRICS else v / n_loss for k, v in sums.items()}
    if "loss" in metrics:
        metrics["loss/mean_per_loss_token"] = metrics["loss"] / n_loss
    return ForwardBackwardOutput(loss_fn_outputs=loss_fn_outputs, metrics=metrics, usage=usage)
