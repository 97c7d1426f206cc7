"""FSDPTrainingClient: two gloo ranks with FSDP2-sharded weights train like one process,
full weights and LoRA, and their checkpoints resume on the other world size.

Run as a script (`python -m torch.distributed.run ... test_fsdp.py OUT`) this file is
the per-rank worker; under pytest it writes the one-process checkpoints the workers
resume from, launches the workers once, and compares. In the test dtype
(tests/numerics.py), as test_distributed.py.

Tolerances. Against one process computing the whole batch in one call (prefix sharing
and the chunked head, its defaults): the loss and every gradient within fp32 rounding,
1e-5 of the largest entry, and each logprob within 1e-5. Weights after an AdamW step are
compared with one process that accumulates the ranks' shards in their order, with the
plain forward FSDP runs (its gradient is the ranks' sum to the bit): within 1e-5, since
Adam's early steps, about lr * sign(g), can blow a rounding difference on a gradient
near zero up to a full learning rate.
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
from prefixgym.engine.trainer.distributed import init_distributed  # noqa: E402
from prefixgym.engine.trainer.fsdp import FSDPTrainingClient  # noqa: E402
from prefixgym.engine.trainer.options import TrainerOptions  # noqa: E402
from prefixgym.engine.trainer.training import TrainingClient  # noqa: E402
from prefixgym.local_service import LocalService  # noqa: E402
from prefixgym.types import AdamParams, Datum, ModelInput  # noqa: E402

NUMERICS = from_environment()
ADAM = AdamParams(learning_rate=1e-3)
LENGTHS = (12, 7, 20, 9, 15)  # five datums: the ranks get three and two
KINDS = ("full", "lora")


def make_datums(seed: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    datums = []
    for n in LENGTHS:
        ids = torch.randint(0, 4096, (n + 1,), generator=gen).tolist()
        weights = [0.0] * (n // 2) + [1.0] * (n - n // 2)
        datums.append(Datum(model_input=ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}))
    return datums


def make_client(kind: str, seed: int, plain: bool = False) -> TrainingClient:
    """A trainer of `tiny` (weights from `seed`): every weight, or LoRA rank-4 adapters.
    `plain`: the forward FSDP runs (no prefix sharing, no chunked head)."""
    options = TrainerOptions(compute_dtype=NUMERICS.dtype, share_prefixes=not plain,
                             chunked_head=not plain)
    service = LocalService(model=load_model("tiny", seed=seed), seed=seed, device="cpu")  # gloo
    if kind == "lora":
        return service.create_lora_training_client(rank=4, seed=seed, options=options)
    return service.create_training_client(options)


def trained(client: TrainingClient) -> dict[str, torch.Tensor]:
    """The trained tensors (every weight, or the adapters), by name."""
    return {k: v.detach().clone() for k, v in client.state_module.state_dict().items()}


def step_like_ranks(client: TrainingClient, datums: list[Datum]) -> None:
    """One update from the ranks' shards accumulated in rank order."""
    for rank in range(2):
        client.forward_backward(datums[rank::2], "cross_entropy").result()
    client.optim_step(ADAM).result()


def worker(out: Path) -> None:
    rank, _ = init_distributed("gloo")
    for kind in KINDS:
        where = out / kind
        # rank 1 starts from other weights: the client must broadcast rank 0's
        trainer = FSDPTrainingClient(make_client(kind, seed=0 if rank == 0 else 123))
        result = trainer.forward_backward(make_datums(1), "cross_entropy").result()
        grads = {n: p.grad.full_tensor() for n, p in trainer.sharded.named_parameters()
                 if p.grad is not None}
        trainer.optim_step(ADAM).result()
        trainer.save_state(where / "ckpt_fsdp")  # rank 0 writes, rank 1 helps gather
        torch.save(trained(trainer.client), where / f"weights1_rank{rank}.pt")
        # resume a one-process checkpoint on two ranks; one more step
        assert trainer.load_state(where / "ckpt_single").result() == 1
        trainer.forward_backward(make_datums(2), "cross_entropy").result()
        trainer.optim_step(ADAM).result()
        torch.save(trained(trainer.client), where / f"weights2_rank{rank}.pt")
        if trainer.is_main:
            torch.save(grads, where / "grads.pt")
            (where / "result.json").write_text(json.dumps({
                "loss": result.metrics["loss"],
                "logprobs": [o["logprobs"] for o in result.loss_fn_outputs],
                "train_loss_tokens": result.usage.train_loss_tokens,
                "train_computed_tokens": result.usage.train_computed_tokens,
            }))
        dist.barrier()
    dist.destroy_process_group()


def assert_close_all(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                     atol: float) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=atol, msg=name)


def test_two_gloo_ranks_shard_like_one_process_and_resume_across_world_sizes(
        tmp_path: Path) -> None:
    single: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for kind in KINDS:
        # the one-process runs: step 1 saved (the workers resume it), then step 2
        reference = make_client(kind, seed=0, plain=True)
        step_like_ranks(reference, make_datums(1))
        reference.save_state(tmp_path / kind / "ckpt_single").result()
        after1 = trained(reference)
        step_like_ranks(reference, make_datums(2))
        single[kind] = {"after1": after1, "after2": trained(reference)}

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    layers = len(load_model("tiny", seed=0).layers)
    rel = NUMERICS.rel(1e-5, layers)
    for kind in KINDS:
        where = tmp_path / kind
        # loss, logprobs and gradients: one process, the whole batch in one call
        whole = make_client(kind, seed=0)
        datums = make_datums(1)
        expected = whole.forward_backward(datums, "cross_entropy").result()
        grads = {n: p.grad for n, p in whole.model.named_parameters() if p.grad is not None}
        result = json.loads((where / "result.json").read_text())
        assert result["loss"] == pytest.approx(expected.metrics["loss"], rel=rel)
        assert result["train_loss_tokens"] == expected.usage.train_loss_tokens
        assert result["train_computed_tokens"] == sum(LENGTHS)  # no prefix shared
        logit_scale = max(max_abs_logit(whole.model, d.model_input.tokens) for d in datums)
        atol = NUMERICS.logprob_atol(1e-5, layers, logit_scale, sides=2)
        for got, want in zip(result["logprobs"], expected.loss_fn_outputs, strict=True):
            assert got == pytest.approx(want["logprobs"], abs=atol)  # in the caller's order
        sharded_grads = torch.load(where / "grads.pt")
        assert sharded_grads.keys() == grads.keys()
        for name, value in grads.items():
            torch.testing.assert_close(sharded_grads[name], value, rtol=0,
                                       atol=rel * float(value.abs().max()), msg=name)
        # weights after the update, on both ranks (what each publishes)
        for rank in (0, 1):
            assert_close_all(torch.load(where / f"weights1_rank{rank}.pt"),
                             single[kind]["after1"], atol=1e-5)
            # two ranks resumed the one-process checkpoint: the one-process step 2
            assert_close_all(torch.load(where / f"weights2_rank{rank}.pt"),
                             single[kind]["after2"], atol=1e-5)
        # one process resumes the two ranks' checkpoint: its weights, then step 2
        resumed = make_client(kind, seed=5 if kind == "full" else 0, plain=True)  # (LoRA: the same base)
        assert resumed.load_state(where / "ckpt_fsdp").result() == 1
        assert_close_all(trained(resumed), single[kind]["after1"], atol=1e-5)
        step_like_ranks(resumed, make_datums(2))
        assert_close_all(trained(resumed), single[kind]["after2"], atol=1e-5)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bad_datum_raises_and_keeps_accumulated_gradients(one_rank_group: None) -> None:
    trainer = FSDPTrainingClient(TrainingClient(load_model("tiny", seed=0)))
    datums = make_datums(1)
    trainer.forward_backward(datums[:2], "cross_entropy").result()
    before = {n: p.grad.full_tensor() for n, p in trainer.sharded.named_parameters()}
    bad = Datum(model_input=ModelInput.from_ints([1, 2, 3]),
                loss_fn_inputs={"target_tokens": [1, 2, 99999]})
    with pytest.raises(ValueError, match="99999"):
        trainer.forward_backward([datums[2], bad], "cross_entropy")
    for n, p in trainer.sharded.named_parameters():
        assert torch.equal(p.grad.full_tensor(), before[n]), n
    trainer.client.close()


def test_a_state_saved_before_any_update_loads_at_step_0(one_rank_group: None,
                                                        tmp_path: Path) -> None:
    trainer = FSDPTrainingClient(TrainingClient(load_model("tiny", seed=0)))
    trainer.save_state(tmp_path / "ckpt")
    assert trainer.load_state(tmp_path / "ckpt").result() == 0
    trainer.forward_backward(make_datums(1), "cross_entropy").result()
    assert trainer.optim_step(ADAM).result().metrics["step"] == 1
    trainer.client.close()


def test_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_distributed"):
        FSDPTrainingClient(TrainingClient(load_model("tiny", seed=0)))


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
