"""DistributedTrainingClient: two gloo ranks under torchrun train like one process.

Run as a script (`python -m torch.distributed.run ... test_distributed.py OUT`) this
file is the per-rank worker; under pytest it launches that worker and compares. The
ranks and the process they are compared with train in the test dtype (tests/numerics.py,
read from PREFIXGYM_TEST_DTYPE, which the workers inherit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the workers too
from numerics import from_environment, max_abs_logit  # noqa: E402

from prefixgym.engine.model import load_model  # noqa: E402
from prefixgym.engine.trainer.distributed import (  # noqa: E402
    DistributedTrainingClient,
    backend_for,
    init_distributed,
    rank_device,
)
from prefixgym.engine.trainer.options import TrainerOptions
from prefixgym.engine.trainer.prefix_trie import shard_by_prefix  # noqa: E402
from prefixgym.engine.trainer.training import TrainingClient  # noqa: E402
from prefixgym.types import AdamParams, Datum, ModelInput  # noqa: E402

NUMERICS = from_environment()

ADAM = AdamParams(learning_rate=1e-3)  # default eps=1e-8
LENGTHS = (12, 7, 20, 9, 15, 11)  # six datums; the first four start with one 6-token prefix
SHARED = 6


def make_datums() -> list[Datum]:
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 4096, (SHARED,), generator=gen).tolist()
    datums = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, 4096, (n + 1,), generator=gen).tolist()
        if i < 4:
            ids[:SHARED] = prefix
        weights = [0.0] * (n // 2) + [1.0] * (n - n // 2)
        datums.append(Datum(model_input=ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}))
    return datums


def shards() -> list[list[int]]:
    return shard_by_prefix([d.model_input.tokens for d in make_datums()], 2)


def worker(out: Path) -> None:
    rank, world = init_distributed("gloo")
    # rank 1 starts from other weights: the client must broadcast rank 0's
    model = load_model("tiny", seed=0 if rank == 0 else 123)
    trainer = DistributedTrainingClient(TrainingClient(model, TrainerOptions(compute_dtype=NUMERICS.dtype)))
    result = trainer.forward_backward(make_datums(), "cross_entropy").result()
    torch.save({n: p.grad.clone() for n, p in model.named_parameters()},
               out / f"grads_rank{rank}.pt")
    trainer.optim_step(ADAM).result()
    trainer.save_state(out / f"ckpt_rank{rank}")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               out / f"weights_rank{rank}.pt")
    if trainer.is_main:
        (out / "result.json").write_text(json.dumps({
            "world": world, "loss": result.metrics["loss"],
            "logprobs": [o["logprobs"] for o in result.loss_fn_outputs],
            "train_loss_tokens": result.usage.train_loss_tokens,
            "ledger_computed": trainer.client.ledger.total().train_computed_tokens,
            "ledger_shared": trainer.client.ledger.total().train_shared_tokens,
        }))
    dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    model = load_model("tiny", seed=0)
    single = TrainingClient(model, TrainerOptions(compute_dtype=NUMERICS.dtype))
    expected = single.forward_backward(make_datums(), "cross_entropy").result()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    single.close()
    # One process accumulating the same two shards: its gradient is g0 + g1, the sum the
    # all-reduce forms, to the bit. (The whole batch in one call sums in another order:
    # equal to fp32 rounding, or bf16's, which Adam's first step, about lr * sign(g), can
    # blow up to a full learning rate on a gradient near zero.)
    model = load_model("tiny", seed=0)
    single = TrainingClient(model, TrainerOptions(compute_dtype=NUMERICS.dtype))
    datums = make_datums()
    computed = 0
    for shard in shards():
        computed += single.forward_backward([datums[i] for i in shard],
                                            "cross_entropy").result().usage.train_computed_tokens
    single.optim_step(ADAM).result()
    single.close()

    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world"] == 2
    # against the whole batch in one call: fp32 up to summation order, bf16 within its bound
    rel = NUMERICS.rel(1e-5, len(model.layers))
    logit_scale = max(max_abs_logit(load_model("tiny", seed=0), d.model_input.tokens)
                      for d in datums)
    atol = NUMERICS.logprob_atol(1e-5, len(model.layers), logit_scale, sides=2)
    assert result["loss"] == pytest.approx(expected.metrics["loss"], rel=rel)
    assert result["train_loss_tokens"] == expected.usage.train_loss_tokens
    # rank 0's ledger counts both ranks; a prefix shared within a rank is computed once
    assert result["ledger_computed"] == computed < sum(LENGTHS)
    assert result["ledger_shared"] == sum(LENGTHS) - computed
    for got, want in zip(result["logprobs"], expected.loss_fn_outputs):
        assert got == pytest.approx(want["logprobs"], abs=atol)  # in the caller's order
    reference = model.state_dict()
    for rank in (0, 1):
        summed = torch.load(tmp_path / f"grads_rank{rank}.pt")
        for name, value in grads.items():
            scale = float(value.abs().max())
            torch.testing.assert_close(summed[name], value, rtol=0, atol=rel * scale, msg=name)
        weights = torch.load(tmp_path / f"weights_rank{rank}.pt")
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)
    assert (tmp_path / "ckpt_rank0").is_dir()
    assert not (tmp_path / "ckpt_rank1").exists()  # only rank 0 writes checkpoints


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bad_datum_raises_and_keeps_accumulated_gradients(one_rank_group: None) -> None:
    trainer = DistributedTrainingClient(TrainingClient(load_model("tiny", seed=0)))
    datums = make_datums()
    trainer.forward_backward(datums[:2], "cross_entropy").result()
    before = [p.grad.clone() for p in trainer.model.parameters()]
    bad = Datum(model_input=ModelInput.from_ints([1, 2, 3]),
                loss_fn_inputs={"target_tokens": [1, 2, 99999]})
    with pytest.raises(ValueError, match="99999"):
        trainer.forward_backward([datums[2], bad], "cross_entropy")
    for p, g in zip(trainer.model.parameters(), before):
        assert torch.equal(p.grad, g)
    trainer.client.close()


def test_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_distributed"):
        DistributedTrainingClient(TrainingClient(load_model("tiny", seed=0)))


if __name__ == "__main__":
    worker(Path(sys.argv[1]))


def test_each_rank_trains_on_its_own_gpu_with_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun, `--device cuda` is the rank's GPU (LOCAL_RANK) and the group NCCL;
    an explicit index, or the CPU, stays as given (gloo). No GPU needed: names only."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert rank_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu")) == torch.device("cpu")
    assert backend_for(torch.device("cuda", 3)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
