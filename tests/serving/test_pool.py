"""SamplerPool over live `prefixgym serve` apps: sticky episodes, spread groups, failover;
RemoteWeightSync: pushes, pinned versions, the shared-filesystem check, adapters."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import gymnasium as gym
import pytest

import prefixgym.envs  # noqa: F401  (registers the env ids)
from prefixgym.engine.model import load_model
from prefixgym.engine.model.hf_export import save_hf_checkpoint
from prefixgym.local_service import LocalService
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts
from prefixgym.serving.config import ServeConfig
from prefixgym.serving.openai_client import OpenAISamplingClient
from prefixgym.serving.pool import AllSamplersFailed, SamplerPool
from prefixgym.serving.weight_sync import RemoteWeightSync
from prefixgym.types import SamplingParams

CONFIG = ServeConfig(model="tiny", max_n=8)


@pytest.fixture
def servers(request, start_server) -> list:
    return [start_server(LocalService(model="tiny", seed=0), CONFIG)
            for _ in range(getattr(request, "param", 2))]


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def rollouts(sampler, tokenizer, seeds: list[int], temperature: float = 0.0):
    runner = Rollouts(sampler, tokenizer,
                      RolloutConfig(temperature=temperature, max_tokens=6, max_turns=3))

    async def run():
        return await asyncio.gather(*(
            runner.run_group([gym.make("prefixgym/GuessNumber-v0") for _ in range(2)], seed,
                             f"g{seed}") for seed in seeds))

    return asyncio.run(run())


def test_episodes_stick_to_their_server_and_groups_spread(servers) -> None:
    tokenizer = servers[0].service.tokenizer
    with SamplerPool([OpenAISamplingClient(s.url, model="tiny") for s in servers]) as pool:
        routed: dict[tuple[int, ...], int] = {}
        route = pool._route

        def recording_route(ids, n, tried):
            routed[tuple(ids)] = route(ids, n, tried)
            return routed[tuple(ids)]

        pool._route = recording_route  # type: ignore[method-assign]
        groups = rollouts(pool, tokenizer, [11, 12, 13, 14], temperature=1.0)
        metrics = pool.metrics()
    firsts = []
    for group in groups:
        for traj in group.trajectories:
            # the server that sampled its first reply (a group's first prompt is everyone's)
            where = [pool._affinity.lookup(traj.tokens[:traj.turns[0].reply_end])]
            where += [routed[tuple(traj.tokens[:turn.reply_start])] for turn in traj.turns[1:]]
            assert len(where) >= 2 and len(set(where)) == 1  # every turn on its first's server
            firsts.append(where[0])
            for before, turn in zip(traj.turns, traj.turns[1:]):  # so its prefix was cached
                assert turn.usage.prefill_cached_tokens >= before.reply_start // 16 * 16
    assert sorted(firsts[::2]) == [0, 0, 1, 1]  # the four groups spread over both servers
    assert metrics["sampler/failed"] == 0 and metrics["sampler/retries"] == 0
    for i in (0, 1):
        assert metrics[f"sampler/{i}/requests"] > 0 and 0 < metrics[f"sampler/{i}/hit_rate"] < 1


def test_a_dead_server_is_left_out_and_its_requests_retried(servers) -> None:
    clients = [OpenAISamplingClient(dead_url(), model="tiny"),
               OpenAISamplingClient(servers[0].url, model="tiny")]
    with SamplerPool(clients) as pool:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        for p in ([5, 6, 7], [8, 9, 10], [5, 6, 7, 1]):
            assert len(pool.sample(p, 2, params).result().sequences) == 2
        metrics = pool.metrics()
        assert metrics["sampler/failed"] == 1 and metrics["sampler/0/up"] == 0
        assert metrics["sampler/retries"] == 1 and metrics["sampler/1/requests"] == 3
        with pytest.raises(ValueError, match="vocabulary"):  # a bad request is not retried
            pool.sample([5, 99_999], 1, params).result()
        assert pool.metrics()["sampler/1/up"] == 1
    with (SamplerPool([OpenAISamplingClient(dead_url(), model="m")]) as nobody,
          pytest.raises(AllSamplersFailed, match="no sampling server")):
        nobody.sample([1, 2], 1).result()


def test_weights_are_pushed_to_every_server_and_samples_are_pinned(servers, tmp_path) -> None:
    model = load_model("tiny", seed=0)
    pool = SamplerPool([OpenAISamplingClient(s.url, model="tiny") for s in servers])
    sync = RemoteWeightSync(None, pool, tmp_path / "w",  # type: ignore[arg-type]
                            lambda path: save_hf_checkpoint(model, path), token="run")
    for version in (1, 2, 3):
        with __import__("torch").no_grad():
            model.tok_embeddings.weight.mul_(1.5)  # another update
        sampler = sync.save_weights_and_get_sampling_client()
        assert (sampler.label, sampler.weights_version) == (f"run-{version}", version)
        for s in servers:
            assert s.service.weights_version == version
        response = sampler.sample([5, 6, 7], 2, SamplingParams(max_tokens=2)).result()
        assert response.weights_version == f"run-{version}"
        assert sampler.compute_logprobs([5, 6, 7]).result()[0] is None
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v000002", "v000003"]
    # the old pinned view refuses the newer weights the servers now hold
    stale = pool.pinned("run-2", 2)
    with pytest.raises(AllSamplersFailed, match="answered from weights 'run-3'"):
        stale.sample([5, 6], 1).result()
    pool.close()


def test_a_server_that_cannot_read_the_weights_stops_the_run(servers, tmp_path) -> None:
    pool = SamplerPool([OpenAISamplingClient(s.url, model="tiny") for s in servers])
    nowhere = RemoteWeightSync(None, pool, tmp_path / "w",  # type: ignore[arg-type]
                               lambda path: None, token="run")  # writes nothing: not shared
    with pytest.raises(ValueError, match="cannot load the published weights.*share a filesystem"):
        nowhere.save_weights_and_get_sampling_client()
    pool.close()


class _AdapterService(LocalService):
    """A server engine with the seam issue 15 fills (the adapter is the base, here)."""

    def create_sampling_client(self, stop_at_end_of_turn: bool = True,  # type: ignore[override]
                               model_path: str | None = None):
        return super().create_sampling_client(stop_at_end_of_turn)


def test_adapters_are_loaded_sampled_by_name_and_unloaded(tmp_path: Path, start_server) -> None:
    running = start_server(_AdapterService(model="tiny", seed=0), CONFIG)
    pool = SamplerPool([OpenAISamplingClient(running.url, model="tiny")])
    sync = RemoteWeightSync(None, pool, tmp_path / "a",  # type: ignore[arg-type]
                            lambda path: path.mkdir(parents=True), token="r", mode="lora")
    try:
        for version in (1, 2, 3):
            sampler = sync.save_weights_and_get_sampling_client()
            response = sampler.sample([5, 6, 7], 1, SamplingParams(max_tokens=2)).result()
            assert response.weights_version == f"r-{version}"
        client = pool.clients[0]
        assert client.loaded_adapters() == {  # the one two versions back was unloaded
            f"r-{v}": str((tmp_path / "a" / f"v{v:06d}").resolve()) for v in (2, 3)}
        # another process of the same run (resumed: new labels, the same weights_dir)
        # unloads what the first left there, and nothing that is not this run's
        (tmp_path / "other").mkdir()
        client.load_lora_adapter("foreign", str(tmp_path / "other"))
        resumed = RemoteWeightSync(None, pool, tmp_path / "a",  # type: ignore[arg-type]
                                   lambda path: path.mkdir(parents=True, exist_ok=True),
                                   token="s", mode="lora")
        resumed.save_weights_and_get_sampling_client()
        assert list(client.loaded_adapters()) == ["foreign", "s-1"]
    finally:
        pool.close()
