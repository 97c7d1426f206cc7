"""`prefixgym train --sampler-url`: rollouts and evaluation go to the HTTP server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixgym.cli.train import build_run
from prefixgym.serving.openai_client import OpenAISamplingClient
from prefixgym.trainer.config import TrainConfig


def test_train_samples_on_the_remote_server(server, tmp_path: Path) -> None:
    before = server.service.usage().sampled_tokens
    config = TrainConfig(out=str(tmp_path), sft_steps=0, steps=1, groups_per_step=1,
                         group_size=2, eval_episodes=2, eval_every=1, max_tokens=4,
                         progress=False, sampler_url=server.url + "/v1")
    run, service = build_run(config)
    result = run.run()
    served = server.service.usage().sampled_tokens - before
    assert served > 0  # every sampled token came from the server...
    assert service.usage().sampled_tokens == served  # ...and is in the run's ledger
    assert result.usage.sampled_tokens == served
    phases = [json.loads(line)["phase"] for line in (tmp_path / "metrics.jsonl").open()]
    assert "grpo" in phases and "eval" in phases


def test_train_sends_the_api_key_from_the_environment(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXGYM_API_KEY", "s3cret")
    config = TrainConfig(out=str(tmp_path), sampler_url="http://127.0.0.1:9/v1",
                         eval_episodes=1, progress=False)
    run, service = build_run(config)
    try:
        sampler = run.clients.sampler
        assert isinstance(sampler, OpenAISamplingClient)
        assert sampler._http.headers["Authorization"] == "Bearer s3cret"
    finally:
        service.close()
