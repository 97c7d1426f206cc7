"""Sharded training under `torchrun` (FSDP2): each rank holds 1/W of the trained
parameters, their gradients and AdamW's moments.

`FSDPTrainingClient` wraps a rank's `TrainingClient` and keeps the single-process
meaning of every call, as `DistributedTrainingClient` does: each rank is given the same
datums and trains `datums[rank::W]`; the gradients are summed across ranks (FSDP2's
reduce-scatter, with sum instead of its default mean), so they equal one process's
gradient of the whole batch up to float rounding. The wrapped client's model stays
whole on every rank -- the *mirror* that publishing, `save_weights_for_sampler`, the
full-weights push and checkpoints read -- and a copy of it is sharded with
`fully_shard` (one FSDP unit per block, the embedding, final norm and head the root's).
One `forward_backward`:
  1) validate the whole request on every rank (the same verdict everywhere);
  2) set the accumulated gradients aside; chunk this rank's datums (right-padded,
     `train_batch.make_chunks`); every rank runs as many forward/backward rounds as the
     rank with the most chunks (a rank out of chunks runs a one-token forward with a
     zero loss), since each round's all-gathers and reduce-scatters are collectives;
  3) all-gather the ranks' outcomes; a rank's error, or a loss or gradient shard that
     is not finite, restores the accumulated gradients on every rank and raises;
  4) add the new gradients to the accumulated ones and return the merged output.
`optim_step` runs AdamW on the shards (the gradient norm is the global one), then
gathers the updated parameters into the mirror: that all-gather is the weight push's.
Not used under FSDP: prefix sharing and the chunked head (both give the same values up
to float rounding; the shared-prefix forward calls the model's parts outside `forward`,
which FSDP2's hooks do not see), custom losses and the routers' load-balancing loss.

Checkpoints have the single-process format (`checkpoint_io`), so they resume on any
world size: rank 0 writes the mirror's weights and the optimizer's state gathered
whole; `load_state` reads them on every rank and takes its shard. Rank 0 *leads*
everything that only it does but every rank must take part in (gathering the
optimizer's state for a save): it broadcasts what comes next, and the other ranks,
waiting in `barrier` (or `save_state`, which is `barrier` there), follow. Calls block
and must be made in the same order on every rank. A failure that validation cannot
foresee (out of memory) inside one rank's forward or backward leaves the ranks'
collectives unmatched: they wait until the process group's timeout ends the job.
Knows nothing of envs or samplers.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Generic

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from prefixgym.engine.checkpoint_io import (
    capture_rng_state,
    load_checkpoint,
    nonfinite_tensor,
    restore_rng_state,
    save_checkpoint,
)
from prefixgym.engine.model import Transformer
from prefixgym.engine.trainer import losses
from prefixgym.engine.trainer.distributed import (
    RankClient,
    broadcast_parameters,
    merge_rank_outputs,
)
from prefixgym.engine.trainer.optimizer import AdamWUpdate, named
from prefixgym.engine.trainer.train_batch import Chunk, PreparedDatum, make_chunks
from prefixgym.engine.trainer.train_pass import PassResult, autocast_for
from prefixgym.engine.trainer.training import SamplerT, TrainingClient
from prefixgym.futures import APIFuture
from prefixgym.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepOutput

__all__ = ["FSDPTrainingClient", "shard_model"]


def shard_model(model: Transformer) -> Transformer:
    """A copy of `model` with its parameters sharded over the default process group, on
    the model's device: each block one FSDP unit, the rest the root's; gradients summed
    across ranks. (FSDP2's own default mesh is CUDA's wherever a GPU is visible, which
    would move a CPU model there.)"""
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    sharded = copy.deepcopy(model)
    for block in sharded.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    for module in sharded.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum, as the losses are
            module.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
    return sharded


class FSDPTrainingClient(RankClient, Generic[SamplerT]):
    """FSDP2 over the default process group; see the module docstring."""

    def __init__(self, client: TrainingClient[SamplerT]) -> None:
        if not dist.is_initialized():
            raise RuntimeError("no process group: call init_distributed() (under torchrun) first")
        cfg = client.model.config
        if client.options.router_aux_loss_coef and any(cfg.is_moe(i) for i in range(cfg.n_layers)):
            raise ValueError("FSDP training does not compute the routers' load-balancing loss: "
                             "set router_aux_loss_coef to 0 or train without FSDP")
        self.client = client
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        broadcast_parameters(client.model)  # every rank starts from rank 0's weights
        names = named(client.model, client.params)
        self.sharded = shard_model(client.model)
        by_name = dict(self.sharded.named_parameters())
        self._mirror = list(client.params)
        self._params = [by_name[n] for n in names]
        self._update = AdamWUpdate(self._params, names, client.options.nonfinite_update)

    @property
    def model(self) -> torch.nn.Module:
        """The whole weights (the mirror), as of the last update or load."""
        return self.client.model

    @property
    def step(self) -> int:
        return self._update.step

    # -- requests ------------------------------------------------------------------

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepOutput]:
        """AdamW on every rank's shards (the same verdict on every rank: the gradient norm
        and the check of the updated weights are global), then the mirror gathered."""
        if not isinstance(adam, AdamParams):
            adam = AdamParams.model_validate(adam)
        start = time.perf_counter()
        out = self._update.apply(adam)
        if not out.metrics["skipped_nonfinite"]:
            with torch.no_grad():
                for whole, shard in zip(self._mirror, self._params, strict=True):
                    whole.copy_(_full(shard))
        self.client.ledger.add_seconds("optim_step", time.perf_counter() - start)
        return APIFuture.completed(out)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplerT:
        """Publish the mirror (gathered at the last update) to this rank's sampler."""
        return self.client.save_weights_and_get_sampling_client(name)

    def save_state(self, path: str | os.PathLike[str],
                   with_optimizer: bool = True) -> APIFuture[str]:
        """Rank 0 writes the checkpoint; the other ranks help gather it (`barrier`)."""
        if not self.is_main:
            self.barrier()
            return APIFuture.completed(os.fspath(path))
        where = os.fspath(path)
        self._lead(("save", with_optimizer))
        state: dict[str, object] = {"step": self._update.step, "rng": capture_rng_state()}
        if with_optimizer:
            state["optimizer"] = self._gathered_optimizer_state()
        try:
            self.client._checked(f"saving a checkpoint to {where}", lambda: save_checkpoint(
                where, self.client.state_module, state))
        except Exception as e:
            self._lead(("failed", f"{type(e).__name__}: {e}"))
            raise
        self._lead(("saved", None))
        return APIFuture.completed(where)

    def load_state(self, path: str | os.PathLike[str], with_optimizer: bool = True
                   ) -> APIFuture[int]:
        """Every rank reads `path` (a filesystem all ranks see) into the mirror and takes
        its shard of the weights and of the optimizer's state."""
        state = load_checkpoint(os.fspath(path), self.client.state_module)
        with torch.no_grad():
            for whole, shard in zip(self._mirror, self._params, strict=True):
                shard.copy_(_sharded_like(whole.detach(), shard))
        for p in self._params:
            p.grad = None
        if not with_optimizer or "optimizer" not in state:
            self._update.load(None, 0)
            return APIFuture.completed(0)
        saved = state["optimizer"]  # (None: saved before the first update)
        self._update.load(None if saved is None else self._sharded_optimizer_state(saved),
                          int(state["step"]))
        restore_rng_state(state["rng"])
        return APIFuture.completed(self._update.step)

    def barrier(self) -> None:
        """Wait for every rank. On rank 0: say so to the others. On the others: take part
        in what rank 0 leads meanwhile (a checkpoint's save) until it says it is done."""
        if self.is_main:
            self._lead(("barrier", None))
            return
        kind, detail = self._receive()
        if kind == "save":
            if detail:  # with the optimizer's state
                self._gathered_optimizer_state()
            kind, detail = self._receive()
            if kind == "failed":
                raise ValueError(f"rank 0 did not save the checkpoint: {detail}")

    # -- the steps ------------------------------------------------------------------

    def _request(self, datums: Sequence[Datum], loss_fn: str,
                 loss_fn_config: Mapping[str, float] | None, backward: bool,
                 ) -> ForwardBackwardOutput:
        start = time.perf_counter()
        try:
            return self._run(datums, loss_fn, loss_fn_config, backward)
        finally:
            self.client.ledger.add_seconds("forward_backward", time.perf_counter() - start)

    def _run(self, datums: Sequence[Datum], loss_fn: str,
             loss_fn_config: Mapping[str, float] | None, backward: bool) -> ForwardBackwardOutput:
        # 1) the same validation on every rank
        prepared, spec, config = self.client._validate(datums, loss_fn, loss_fn_config)
        shards = [list(range(r, len(prepared), self.world_size)) for r in range(self.world_size)]
        mine = [prepared[i] for i in shards[self.rank]]
        # 2) this rank's chunks, in as many rounds as any rank has
        device = self.client.model.output_weight.device
        chunks = make_chunks(mine, self.client.options.max_tokens_per_forward, device) \
            if mine else []
        rounds = torch.tensor([len(chunks)], device=device)  # (NCCL reduces device tensors)
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
        saved = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        result = PassResult([[] for _ in mine], 0.0, {}, [], sum(c.computed_tokens for c in chunks))
        error: str | None = None
        for k in range(int(rounds)):
            if k < len(chunks) and error is None:
                try:
                    self._chunk(chunks[k], mine, spec, config, backward, result)
                    continue
                except Exception as e:  # noqa: BLE001 - every rank must learn of it, or they hang
                    error = f"{type(e).__name__}: {e}"
            self._idle_round(backward)
        for module in self.sharded.modules():  # (FSDP2 keeps the root gathered otherwise)
            if isinstance(module, FSDPModule):
                module.reshard()
        if error is None and not math.isfinite(result.loss):
            error = f"the loss ({result.loss}) is not finite"
        if error is None and backward:
            bad = nonfinite_tensor((n, _local(p.grad)) for n, p in
                                   zip(self._update.names, self._params) if p.grad is not None)
            if bad is not None:
                error = f"the gradient of {bad} is not finite"
        # 3) everyone's outcome
        outcome = result.output(mine).model_dump() if error is None else error
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, outcome)
        errors = [(r, o) for r, o in enumerate(gathered) if isinstance(o, str)]
        if errors:
            for p, g in zip(self._params, saved, strict=True):
                p.grad = g
            rank, message = errors[0]
            raise ValueError(f"forward_backward failed on rank {rank} (gradients left "
                             f"unchanged on every rank): {message}")
        # 4) the gradients accumulated, the merged output
        for p, g in zip(self._params, saved, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        outputs = [(r, ForwardBackwardOutput.model_validate(o)) for r, o in enumerate(gathered)]
        merged = merge_rank_outputs(outputs, shards, len(datums))
        self.client.ledger.add(merged.usage)
        return merged

    def _chunk(self, chunk: Chunk, mine: list[PreparedDatum], spec: losses.LossSpec,
               config: dict[str, float], backward: bool, result: PassResult) -> None:
        """One chunk: forward through the sharded model, loss, backward; sums into `result`."""
        autocast = autocast_for(self.client.model, self.client.options.compute_dtype)
        with torch.set_grad_enabled(backward):
            with autocast():
                logits_B_T_V = self.sharded(chunk.tokens_B_T,
                                            recompute=self.client.options.recompute_activations)
            logprobs_B_T = losses.target_logprobs_of_logits(logits_B_T_V,
                                                            chunk.inputs["target_tokens"])
            loss, sums = losses.loss_of(spec, logprobs_B_T, chunk.inputs, config)
            if backward:
                loss.backward()
        result.add_chunk(loss, sums, logprobs_B_T, chunk, mine)

    def _idle_round(self, backward: bool) -> None:
        """A round's collectives with nothing to train: a one-token forward, zero loss."""
        device = self.client.model.output_weight.device
        with torch.set_grad_enabled(backward):
            logits = self.sharded(torch.zeros((1, 1), dtype=torch.long, device=device))
            if backward:
                (logits.sum() * 0.0).backward()

    def _lead(self, message: tuple[str, object]) -> None:
        dist.broadcast_object_list([message], src=0)

    def _receive(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gathered_optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer's state dict with every shard gathered whole (a collective):
        what one process's optimizer would hold."""
        state = self._update.state_dict()
        if state is None:
            return None
        return {**state, "state": {i: {k: _full(v) for k, v in s.items()}
                                   for i, s in state["state"].items()}}

    def _sharded_optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A whole optimizer state dict, each moment cut to this rank's shard."""
        out: dict[int, dict[str, Any]] = {}
        for i, s in state["state"].items():
            param = self._params[int(i)]
            out[i] = {k: _sharded_like(v, param) if k != "step" else v for k, v in s.items()}
        return {**state, "state": out}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sharded_like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`whole` cut as `param` is sharded (each rank cuts its own copy: no communication)."""
    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements,
                             src_data_rank=None)
