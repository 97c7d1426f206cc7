"""`prefixgym train --sampler-url`: rollouts and evaluation go to the HTTP server, which
receives every update and answers only from it (async LoRA against prefixgym serve and
a real vLLM; an agent program's calls too)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from numerics import tiny_logprob_atol

from prefixgym.cli.train import build_run
from prefixgym.local_service import LocalService
from prefixgym.serving.config import ServeConfig
from prefixgym.serving.openai_client import OpenAISamplingClient
from prefixgym.trainer import run as run_module
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.grpo import StepPipeline


def test_train_samples_on_the_remote_server(start_server, tmp_path: Path, numerics) -> None:
    server = start_server(LocalService(model="tiny", seed=5))  # not the trainer's weights
    config = TrainConfig(out=str(tmp_path), env="tests/Lengthy-v0", sft_steps=0, steps=2,
                         groups_per_step=2, group_size=2, eval_episodes=2, eval_every=1,
                         max_tokens=4, compute_dtype=numerics.name,
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
    # on-policy: the server's fp32 numbers against the trainer's, which round otherwise
    # in bf16 (tests/numerics.py)
    bound = tiny_logprob_atol(numerics, fp32=1e-3)
    on_policy = [r["sampler/max_logprob_gap"] for r in steps if "sampler/max_logprob_gap" in r]
    assert on_policy and all(gap < bound for gap in on_policy)


@pytest.mark.parametrize(("flag", "message"), [({"async_mode": True}, "LoRA"),
                                               ({"max_staleness": 1}, "LoRA"),
                                               ({"max_staleness": 2}, "LoRA"),
                                               ({"kl_coef": 0.1}, "in-process")])
def test_remote_sync_refuses_what_needs_older_versions(flag, message, tmp_path: Path) -> None:
    config = TrainConfig(out=str(tmp_path), sampler_url=["http://127.0.0.1:9/v1"], **flag)
    with pytest.raises(ValueError, match=message):
        build_run(config)


@pytest.fixture(params=["prefixgym", pytest.param(
    "vllm", marks=[pytest.mark.vllm, pytest.mark.xdist_group("vllm")])])
def base_server_url(request: pytest.FixtureRequest, start_server) -> str:
    """A server on the trainer's base weights (tiny, seed 0): prefixgym serve, or the
    session's real vLLM."""
    if request.param == "vllm":
        return str(request.getfixturevalue("vllm").url)
    return str(start_server(LocalService(model="tiny", seed=0)).url)


def test_a_lora_run_pushes_adapters_and_samples_one_version_behind(base_server_url: str,
                                                                  tmp_path: Path,
                                                                  numerics) -> None:
    config = TrainConfig(out=str(tmp_path), env="tests/Lengthy-v0", sft_steps=0, steps=3,
                         groups_per_step=2, group_size=2, eval_episodes=2, eval_every=10,
                         checkpoint_every=10, max_tokens=4, progress=False,
                         sampler_url=[base_server_url + "/v1"], lora_rank=4, async_mode=True,
                         compute_dtype=numerics.name)
    run, service = build_run(config)
    run.run()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    steps = [r for r in lines if r["phase"] == "grpo"]
    # step 1 waits for step 0's weights (the evaluation at the start is a checkpoint
    # point: resuming stays exact); step 2 samples while step 1 trains
    assert [r["sampler/version_lag"] for r in steps] == [0.0, 0.0, 1.0]
    gaps = [r["sampler/max_logprob_gap"] for r in steps if "sampler/max_logprob_gap" in r]
    # lag 0: the served numbers are the trainer's (up to its rounding: tests/numerics.py);
    # lag 1: one update's size apart
    bound = tiny_logprob_atol(numerics, fp32=1e-3)
    assert gaps[0] < bound and gaps[1] < bound and len(gaps) == 3
    pushed = sorted(p.name for p in (tmp_path / "sampler_weights").iterdir())
    assert pushed and all((tmp_path / "sampler_weights" / p / "adapter_config.json").is_file()
                          for p in pushed)



class _ChecksOneLess(StepPipeline):
    """Samples up to K steps ahead but checks against K - 1: forced staleness, as a
    sampler fleet that ran further ahead than the trainer allows."""

    def take(self, sampler, step, last_step):
        result, weights = super().take(sampler, step, last_step)
        return result, dataclasses.replace(weights, max_staleness=self._ahead - 1)


@pytest.mark.parametrize(("base_server_url", "forced"), [
    ("prefixgym", False), ("prefixgym", True),
    pytest.param("vllm", False, marks=[pytest.mark.vllm, pytest.mark.xdist_group("vllm")])],
    indirect=["base_server_url"])
def test_a_lora_run_at_staleness_two(base_server_url: str, tmp_path: Path, numerics,
                                     monkeypatch: pytest.MonkeyPatch, forced: bool) -> None:
    """--max-staleness 2 with --sampler-url: the server keeps the newest three adapters
    loaded (vLLM, started with --max-loras 2, reloads an evicted one from its
    directory), every sample carries the label of the adapter that drew it (none is
    refused), and steps train two versions behind; forced further behind than allowed,
    they are dropped and counted."""
    if forced:
        monkeypatch.setattr(run_module, "StepPipeline", _ChecksOneLess)
    config = TrainConfig(out=str(tmp_path), env="tests/Lengthy-v0", sft_steps=0, steps=5,
                         groups_per_step=2, group_size=2, eval_episodes=2, eval_every=10,
                         checkpoint_every=10, max_tokens=4, progress=False,
                         sampler_url=[base_server_url + "/v1"], lora_rank=4, max_staleness=2,
                         compute_dtype=numerics.name)
    run, service = build_run(config)
    run.run()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    steps = [r for r in lines if r["phase"] == "grpo"]
    # step 1 waits for step 0's weights (a checkpoint point), steps 2 and 3 start
    # sampling when step 1 trains, step 4 when step 2 does
    assert [r["sampler/version_lag"] for r in steps] == [0.0, 0.0, 1.0, 2.0, 2.0]
    token = run.training.token  # the run's labels: <token>-<version>
    published = run.training.published
    with OpenAISamplingClient(base_server_url) as client:  # the newest and the two before
        assert set(client.loaded_adapters()) == {
            f"{token}-{v}" for v in range(published - 2, published + 1)}
    pushed = sorted(p.name for p in (tmp_path / "sampler_weights").iterdir())
    assert pushed == [f"v{v:06d}" for v in range(published - 2, published + 1)]
    for r in steps:
        lag = int(r["sampler/version_lag"])
        if forced and lag == 2:  # older than the K checked: dropped, counted
            assert r["episodes/stale"] == r["episodes/off_policy"] == 4
            assert r["staleness/2"] == 0 and "sampler/max_logprob_gap" not in r
        else:
            assert r["episodes/stale"] == r["episodes/off_policy"] == 0
            assert r[f"staleness/{lag}"] == 4 and "sampler/kl_k3" in r
    report = (tmp_path / "report.md").read_text()
    assert "## Staleness" in report
    assert ("8 episodes were dropped" in report) == forced


def test_train_sends_the_api_key_from_the_environment(start_server, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    server = start_server(LocalService(model="tiny", seed=0),
                          ServeConfig(model="tiny", api_key="s3cret"))
    config = TrainConfig(out=str(tmp_path), sampler_url=[server.url + "/v1"],
                         eval_episodes=1, progress=False)
    with pytest.raises(ValueError, match="401|API key"):  # the first push is refused
        build_run(config)
    assert server.service.weights_version == 0  # nothing was loaded
    monkeypatch.setenv("PREFIXGYM_API_KEY", "s3cret")
    run, service = build_run(config)  # the starting weights are pushed with the key
    try:
        assert server.service.weights_version == 1  # the starting weights arrived
    finally:
        service.close()


AGENT = '''
from openai import OpenAI

def agent(base_url, api_key, model, task):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    reply = client.chat.completions.create(model=model, messages=messages)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Once more."}]
    again = client.chat.completions.create(model=model, messages=messages)
    return float(again.choices[0].token_ids[0] % 2)
'''


def test_an_agent_run_samples_on_the_remote_server(start_server, tmp_path: Path,
                                                   numerics) -> None:
    """--agent with --sampler-url: every call of the program is sampled by the server,
    which holds the trainer's newest weights, and its second call reads the first from
    the server's prefix cache."""
    pytest.importorskip("openai")
    server = start_server(LocalService(model="tiny", seed=5))  # not the trainer's weights
    (tmp_path / "agent.py").write_text(AGENT)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"{i} + {i}?"}) + "\n" for i in range(3)))
    config = TrainConfig(out=str(tmp_path / "run"), agent=f"{tmp_path / 'agent.py'}:agent",
                         tasks=str(tasks), sft_steps=0, steps=2, groups_per_step=2,
                         group_size=2, eval_episodes=2, eval_every=2, max_tokens=4,
                         compute_dtype=numerics.name, progress=False,
                         sampler_url=[server.url + "/v1"])
    run, service = build_run(config)
    result = run.run()
    served = server.service.usage()
    assert served.sampled_tokens > 0 and result.usage.sampled_tokens == served.sampled_tokens
    assert served.prefill_cached_tokens > 0  # second calls extend the first, token for token
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in lines if r["phase"] == "grpo"]
    assert [r["sampler/version_lag"] for r in steps] == [0.0, 0.0]
    assert all(r["episodes/failed"] == 0 and not r.get("agent/branches") for r in steps)
    trained = service.train_model.state_dict()
    for name, value in server.service.train_model.state_dict().items():
        assert bool((value == trained[name]).all()), name
