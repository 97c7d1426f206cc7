"""OpenAISamplingClient against `prefixgym serve` (and a fake vLLM-like server)."""

from __future__ import annotations

import asyncio
import json

import gymnasium as gym
import httpx
import pytest

import prefixgym.envs  # noqa: F401  (registers the env ids)
from prefixgym.engine.usage import UsageLedger
from prefixgym.rollouts.rollout import RolloutConfig, Rollouts
from prefixgym.serving.openai_client import OpenAISamplingClient
from prefixgym.types import ModelInput, SamplingParams

PROMPT = [(11 * i + 5) % 4000 + 50 for i in range(36)]


@pytest.fixture
def remote(server):
    client = OpenAISamplingClient(server.url, ledger=UsageLedger())
    yield client
    client.close()


def test_sample_matches_the_in_process_engine(server, remote) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0)
    got = remote.sample(ModelInput.from_ints(PROMPT), 2, params).result()
    want = server.service.create_sampling_client().sample(PROMPT, 2, params).result()
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    for g, w in zip(got.sequences, want.sequences):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert g.stop_reason == w.stop_reason
    assert got.usage.prefill_tokens == len(PROMPT)
    assert got.usage.sampled_tokens == 10


def test_usage_maps_cached_tokens_into_the_ledger(remote) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = asyncio.run(_await(remote.sample(PROMPT, 1, params)))  # await works too
    extended = PROMPT + first.sequences[0].tokens + [70, 71]
    second = remote.sample(extended, 1, params).result()
    assert second.usage.prefill_cached_tokens > 0
    assert second.usage.prefill_computed_tokens + second.usage.prefill_cached_tokens == len(extended)
    total = remote.ledger.total()
    assert total.prefill_tokens == len(PROMPT) + len(extended)
    assert total.sampled_tokens == 8


async def _await(future):
    return await future


def test_compute_logprobs_and_prompt_logprobs(server, remote) -> None:
    want = server.service.create_sampling_client().compute_logprobs(PROMPT[:12]).result()
    got = remote.compute_logprobs(PROMPT[:12]).result()
    assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-4)
    resp = remote.sample(PROMPT[:12], 1, SamplingParams(max_tokens=3, temperature=0.0),
                         include_prompt_logprobs=True).result()
    assert resp.prompt_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    assert len(resp.sequences[0].tokens) == len(resp.sequences[0].logprobs) == 3


def test_server_errors_become_value_errors(remote) -> None:
    with pytest.raises(ValueError, match="HTTP 400.*vocabulary"):
        remote.sample([1, 2, 99_999], 1, SamplingParams(max_tokens=1)).result()
    with pytest.raises(ValueError, match="negative"):
        remote.sample([-1], 1)
    with pytest.raises(ValueError, match="num_samples"):
        remote.sample([1], 0)


def test_greedy_rollout_over_http_equals_in_process(server, remote) -> None:
    config = RolloutConfig(temperature=0.0, max_tokens=8, max_turns=3)
    tokenizer = server.service.tokenizer

    def run(sampler):
        rollouts = Rollouts(sampler, tokenizer, config)
        envs = [gym.make("prefixgym/GuessNumber-v0") for _ in range(2)]
        return asyncio.run(rollouts.run_group(envs, 3, "g"))

    over_http = run(remote)
    in_process = run(server.service.create_sampling_client())
    assert [t.tokens for t in over_http.trajectories] == [t.tokens for t in in_process.trajectories]
    assert all(len(t.turns) >= 2 for t in over_http.trajectories)  # later turns hit the cache
    assert all(t.extension_ok for t in over_http.trajectories)


def _fake_vllm(token_field: bool, tokens_as_ids: bool):
    """A server answering like a vLLM without return_token_ids and without cache details."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        assert body["prompt"] == [1, 2, 3] and body["model"] == "m"
        choice = {"index": 0, "text": "hi", "finish_reason": "stop",
                  "logprobs": {"tokens": ["token_id:10", "token_id:11"] if tokens_as_ids
                               else ["h", "i"], "token_logprobs": [-0.5, -0.25]}}
        if token_field:
            choice["token_ids"] = [10, 11]
        return httpx.Response(200, json={"choices": [choice],
                                         "usage": {"prompt_tokens": 3, "completion_tokens": 2}})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize(("token_field", "tokens_as_ids"), [(True, False), (False, True)])
def test_token_ids_from_a_vllm_like_server(token_field: bool, tokens_as_ids: bool) -> None:
    with OpenAISamplingClient("http://fake", transport=_fake_vllm(token_field, tokens_as_ids)) as c:
        resp = c.sample([1, 2, 3]).result()
    seq = resp.sequences[0]
    assert seq.tokens == [10, 11] and seq.logprobs == [-0.5, -0.25] and seq.stop_reason == "stop"
    assert resp.usage.prefill_computed_tokens == 3 and resp.usage.prefill_cached_tokens == 0


def test_no_token_ids_needs_a_tokenizer_and_warns(server) -> None:
    transport = _fake_vllm(token_field=False, tokens_as_ids=False)
    with (OpenAISamplingClient("http://fake/v1", transport=transport) as c,
          pytest.raises(ValueError, match="no token ids")):
        c.sample([1, 2, 3]).result()
    tokenizer = server.service.tokenizer
    with (OpenAISamplingClient("http://fake/v1", transport=transport, tokenizer=tokenizer) as c,
          pytest.warns(UserWarning, match="re-tokenizing")):
        seq = c.sample([1, 2, 3]).result().sequences[0]
    assert seq.tokens == tokenizer.encode("hi", add_special_tokens=False)


def test_weight_routes_against_a_vllm_like_and_an_sglang_like_server() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/load_lora_adapter":  # SGLang's name for it
            return httpx.Response(200, json={"success": True, "error_message": None})
        return httpx.Response(404, json={"detail": "Not Found"})  # FastAPI's unknown route

    with OpenAISamplingClient("http://fake/v1", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(ValueError, match="no route that loads full weights.*"
                                             "VLLM_SERVER_DEV_MODE=1"):
            c.update_weights_from_disk("/shared/w/v000001", "run-1")
        c.load_lora_adapter("run-1", "/shared/w/v000001")
    assert seen == ["/update_weights_from_disk", "/pause", "/v1/load_lora_adapter",
                    "/load_lora_adapter"]


def _vllm_dev_mode(seen: list[str], reload_fails: bool = False) -> httpx.MockTransport:
    """vLLM 0.32 with VLLM_SERVER_DEV_MODE=1, as its RL routes answer."""
    state = {"version": "default"}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        seen.append(path)
        body = json.loads(request.content) if request.content else {}
        if path == "/collective_rpc":
            assert body == {"method": "reload_weights",
                            "kwargs": {"weights_path": "/shared/w/v000002"}}
            if reload_fails:
                return httpx.Response(500, json={"error": {"message": "Worker failed"}})
            return httpx.Response(200, json={"results": [None]})
        if path == "/pause":
            assert request.url.params["mode"] == "wait"  # requests in flight finish
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if path == "/update_weight_version":
            state["version"] = body["new_version"]
            return httpx.Response(200, json={"success": True})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": state["version"]})
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handler)


def test_full_weights_reach_vllm_through_its_development_routes() -> None:
    seen: list[str] = []
    with OpenAISamplingClient("http://fake/v1", transport=_vllm_dev_mode(seen)) as c:
        assert c.served_weights_version() == "default"
        c.update_weights_from_disk("/shared/w/v000002", "run-2")
        assert c.served_weights_version() == "run-2"
    # paused while the weights change; the prefix cache, computed by the old weights,
    # emptied before anything samples again
    assert seen == ["/weight_info", "/update_weights_from_disk", "/pause", "/collective_rpc",
                    "/reset_prefix_cache", "/update_weight_version", "/resume",
                    "/weight_info"]


def test_a_failed_vllm_reload_says_why_and_resumes() -> None:
    seen: list[str] = []
    with (OpenAISamplingClient("http://fake/v1",
                               transport=_vllm_dev_mode(seen, reload_fails=True)) as c,
          pytest.raises(ValueError, match="share a filesystem")):
        c.update_weights_from_disk("/shared/w/v000002", "run-2")
    assert seen[-2:] == ["/collective_rpc", "/resume"]  # never labelled, not left paused


@pytest.mark.parametrize("drop", [
    httpx.RemoteProtocolError("Server disconnected without sending a response."),
    httpx.ReadError("[Errno 104] Connection reset by peer"),
], ids=["no-answer", "reset"])
def test_a_request_on_a_connection_the_server_closed_goes_out_once_more(
        drop: httpx.HTTPError) -> None:
    """uvicorn closes a kept-alive connection after 5 s idle: a request sent on it as it
    closes gets no answer, or, under load, a reset; the client sends it again, once."""
    answer = _fake_vllm(token_field=True, tokens_as_ids=False)
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path.endswith("/completions") and len(calls) in (2, 4, 5):
            raise drop
        return answer.handle_request(request)

    with OpenAISamplingClient("http://fake", transport=httpx.MockTransport(handler)) as c:
        assert c.sample([1, 2, 3]).result().sequences[0].tokens == [10, 11]
        assert calls == ["/v1/models", "/v1/completions", "/v1/completions"]
        with pytest.raises(ConnectionError, match=str(drop)[:12]):
            c.sample([1, 2, 3]).result()  # twice in a row: the server is gone
    assert len(calls) == 5


def test_a_weight_route_on_a_reset_connection_goes_out_once_more() -> None:
    """The admin routes (adapters, weights) take the same one retry as sampling."""
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.ReadError("[Errno 104] Connection reset by peer")
        return httpx.Response(200, text="Success")

    with OpenAISamplingClient("http://fake", model="m",
                              transport=httpx.MockTransport(handler)) as c:
        c.unload_lora_adapter("run-1")
    assert calls == ["/v1/unload_lora_adapter", "/v1/unload_lora_adapter"]
