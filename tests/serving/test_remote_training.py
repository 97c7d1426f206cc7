"""`prefixgym train --sampler-url`: rollouts and evaluation go to the HTTP server, which
receives every update and answers only from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixgym.cli.train import build_run
from prefixgym.local_service import LocalService
from prefixgym.trainer.config import TrainConfig


def test_train_samples_on_the_remote_server(start_server, tmp_path: Path) -> None:
    server = start_server(LocalService(model="tiny", seed=5))  # not the trainer's weights
    config = TrainConfig(out=str(tmp_path), sft_steps=0, steps=2, groups_per_step=2,
                         group_size=2, eval_episodes=2, eval_every=1, max_tokens=4,
                         progress=False, sampler_url=[server.url + "/v1"])
    run, service = build_run(config)
    result = run.run()
    served = server.service.usage().sampled_tokens
    assert served > 0  # every sampled token came from the server...
    assert service.usage().sampled_tokens == served  # ...and is in the run's ledger
    assert result.usage.sampled_tokens == served
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    steps = [r for r in lines if r["phase"] == "grpo"]
    assert [r["sampler/version_lag"] for r in steps] == [0.0, 0.0]
    assert all(r["episodes/off_policy"] == 0 and r["sampler/0/up"] == 1 for r in steps)
    # the server holds the trainer's newest weights: the start's, then one per step
    assert server.service.weights_version == 1 + 1 + 2  # cli, run start, two steps
    trained = service.train_model.state_dict()
    for name, value in server.service.train_model.state_dict().items():
        assert bool((value == trained[name]).all()), name
    on_policy = [r["sampler/max_logprob_gap"] for r in steps if "sampler/max_logprob_gap" in r]
    assert all(gap < 1e-3 for gap in on_policy)


@pytest.mark.parametrize(("flag", "message"), [({"async_mode": True}, "LoRA"),
                                               ({"kl_coef": 0.1}, "in-process")])
def test_remote_sync_refuses_what_needs_older_versions(flag, message, tmp_path: Path) -> None:
    config = TrainConfig(out=str(tmp_path), sampler_url=["http://127.0.0.1:9/v1"], **flag)
    with pytest.raises(ValueError, match=message):
        build_run(config)


def test_a_lora_run_pushes_the_adapter_the_training_client_writes(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from prefixgym.cli.train import sync_mode, weights_writer
    from prefixgym.futures import APIFuture

    written: list[Path] = []

    class AdapterTrainer:  # issue 15's training client, as far as the push needs it
        def save_weights_for_sampler(self, path):
            written.append(path)
            return APIFuture.completed(str(path))

    assert sync_mode(TrainConfig()) == "full"
    assert sync_mode(SimpleNamespace(lora_rank=8)) == "lora"  # type: ignore[arg-type]
    write = weights_writer("lora", AdapterTrainer())  # type: ignore[arg-type]
    write(tmp_path / "v000001")
    assert written == [tmp_path / "v000001"]
    ddp = SimpleNamespace(client=AdapterTrainer())  # DistributedTrainingClient wraps one
    weights_writer("lora", ddp)(tmp_path / "v000002")  # type: ignore[arg-type]
    assert written[-1] == tmp_path / "v000002"
