"""Sharded training (FSDP2, `--fsdp`) vs data parallel (DDP) over 2 gloo ranks on CPU:
seconds per training step and bytes of training state per rank.

One step = `forward_backward` of `--datums` random datums of `--seq` tokens (every rank
is given all of them and trains its half) + one AdamW update. Both clients wrap a
`TrainingClient` of the same preset with the same weights, in one torchrun job, and
run interleaved (DDP, FSDP, DDP, FSDP, ...) so the machine's load hits both alike;
medians over `--rounds` rounds after one warm-up step each. Each client runs as
`prefixgym train` would run it: DDP with its defaults (the chunked head; random datums
share no prefix), FSDP with the plain head (module docstring of engine/trainer/fsdp.py).

Training state per rank, counted from the tensors: parameters, gradients (after
forward_backward) and AdamW's moments; for FSDP the local shards plus the whole copy
of the weights each rank keeps for publishing (the mirror).

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/bench_fsdp.py --presets tiny small --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import common  # noqa: F401 - sets OMP_WAIT_POLICY=PASSIVE before torch starts its threads
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from prefixgym.engine.model import load_model
from prefixgym.engine.trainer.distributed import DistributedTrainingClient, init_distributed
from prefixgym.engine.trainer.fsdp import FSDPTrainingClient
from prefixgym.engine.trainer.training import TrainingClient
from prefixgym.types import AdamParams, Datum, ModelInput

ADAM = AdamParams(learning_rate=1e-4)


def datums(n: int, seq: int, vocab: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq + 1,), generator=gen).tolist()
        out.append(Datum(model_input=ModelInput.from_ints(ids[:-1]),
                         loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * seq}))
    return out


def local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None,
                grads: int) -> dict[str, int]:
    moments = [] if optimizer is None else [
        v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    return {"params": local_bytes(params), "grads": grads, "adam": local_bytes(moments)}


def step(client: Any, batch: list[Datum], params: list[torch.nn.Parameter]) -> tuple[float, int]:
    """Seconds of one step, and the gradients' bytes before the update zeroes them."""
    dist.barrier()
    t0 = time.perf_counter()
    client.forward_backward(batch, "cross_entropy").result()
    grads = local_bytes(p.grad for p in params if p.grad is not None)
    client.optim_step(ADAM).result()
    dist.barrier()
    return time.perf_counter() - t0, grads


def bench(preset: str, rounds: int, n: int, seq: int) -> dict[str, Any]:
    batch = datums(n, seq, load_model(preset, seed=0).config.vocab_size)
    ddp = DistributedTrainingClient(TrainingClient(load_model(preset, seed=0)))
    fsdp = FSDPTrainingClient(TrainingClient(load_model(preset, seed=0)))
    contenders = {
        "ddp": (ddp, list(ddp.model.parameters()), lambda: ddp.client._optimizer, []),
        "fsdp": (fsdp, list(fsdp.sharded.parameters()), lambda: fsdp._update.optimizer,
                 list(fsdp.model.parameters())),
    }
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    state: dict[str, dict[str, int]] = {}
    for r in range(rounds + 1):
        for name, (client, params, optimizer, mirror) in contenders.items():
            s, grads = step(client, batch, params)
            if r:  # (round 0 warms up)
                seconds[name].append(s)
            state[name] = state_bytes(params, optimizer(), grads)
            state[name]["mirror"] = local_bytes(mirror)
    med = {name: statistics.median(v) for name, v in seconds.items()}
    return {"preset": preset, "datums": n, "seq": seq, "rounds": rounds,
            "seconds_per_step": med, "fsdp_over_ddp": med["fsdp"] / med["ddp"],
            "state_bytes_per_rank": state,
            "state_total": {k: sum(v.values()) for k, v in state.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--datums", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    rank, world = init_distributed("gloo")
    for preset in args.presets:
        result = bench(preset, args.rounds, args.datums, args.seq)
        if rank == 0:
            print(json.dumps({"world": world, "threads": torch.get_num_threads(), **result}),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
