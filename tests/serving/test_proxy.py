"""`prefixgym proxy`: the agent gateway in front of a real `prefixgym serve`, recording
each session token for token; its keys, its faults, and what it sends upstream."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

openai = pytest.importorskip("openai")

from prefixgym.cli.proxy import ProxyConfig, build_proxy, main  # noqa: E402
from prefixgym.prompting.call_tree import CallTree  # noqa: E402
from prefixgym.prompting.chat_format import ChatMLFormat  # noqa: E402
from prefixgym.prompting.tokenizer import load_tokenizer  # noqa: E402
from prefixgym.serving.agent_session import SamplingDefaults  # noqa: E402
from prefixgym.serving.openai_client import OpenAISamplingClient  # noqa: E402
from prefixgym.serving.proxy import RecordingProxy  # noqa: E402

KEY = "secret"


@pytest.fixture
def record(tmp_path):
    return tmp_path / "sessions.jsonl"


@pytest.fixture
def proxy(server, record):
    """A proxy in front of the session's `prefixgym serve` (tiny), with an API key."""
    running = build_proxy(ProxyConfig(upstream=server.url, port=0, record=str(record),
                                      api_key=KEY, max_tokens=8))
    running.start()
    yield running
    running.stop()


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def client_at(url: str, api_key: str = KEY):
    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)


def dead_url() -> str:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_conversation_is_recorded_as_the_tokens_the_upstream_sampled(proxy, record):
    client = client_at(proxy.gateway.url + "/v1")
    assert [m.id for m in client.models.list()] == ["tiny"]  # the upstream's first model
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Name a colour."}]
    choices, cached = [], []
    for turn in range(3):
        reply = client.chat.completions.create(model="tiny", messages=messages)
        choices.append(reply.choices[0])
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"Another one ({turn})."}]
    answer = httpx.post(proxy.gateway.url + "/v1/close",
                        headers={"Authorization": f"Bearer {KEY}"}).json()
    assert answer == {"session": "default", "sequences": 1}

    [line] = records(record)
    assert (line["session"], line["sequence"], line["branch"], line["branch_notes"]) == \
        ("default", 0, 0, [])
    sampled = [c.model_extra["token_ids"] for c in choices]
    prompts = [c.model_extra["prompt_token_ids"] for c in choices]
    # the recorded sampled tokens are the ids the proxy answered with, in order
    tokens, mask = line["tokens"], line["sampled_mask"]
    assert [t for t, m in zip(tokens, mask) if m] == [t for ids in sampled for t in ids]
    assert len(line["turns"]) == 3
    for turn, ids, choice in zip(line["turns"], sampled, choices):
        assert tokens[turn["reply_start"]:turn["reply_end"]] == ids
        assert line["logprobs"][turn["reply_start"]:turn["reply_end"]] == \
            [p.logprob for p in choice.logprobs.content]
        assert turn["stop_reason"] in ("stop", "length")
    # each prompt extends the previous prompt + reply, so the upstream's cache serves it
    for prev, ids, nxt in zip(prompts, sampled, prompts[1:]):
        assert nxt[:len(prev) + len(ids)] == prev + ids
    assert tokens[:len(prompts[-1])] == prompts[-1]
    assert cached[1] > 0 and cached[2] > 0


def test_each_key_is_a_session_opened_by_its_first_call(proxy, record):
    url = proxy.gateway.url
    for key in ("a", "b"):
        reply = client_at(f"{url}/rollouts/{key}/v1").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"session {key}"}])
        assert reply.choices[0].model_extra["token_ids"]
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}/rollouts/a/close", headers=auth).json() == \
        {"session": "a", "sequences": 1}
    assert [r["session"] for r in records(record)] == ["a"]
    closed = httpx.post(f"{url}/rollouts/a/close", headers=auth)
    assert closed.status_code == 404 and "no session 'a'" in closed.json()["error"]["message"]
    # the responses route opens a session too; sessions still open are recorded at stop
    response = client_at(f"{url}/rollouts/c/v1").responses.create(model="tiny", input="hello")
    assert response.output_text is not None
    assert proxy.stop() == 2
    assert sorted(r["session"] for r in records(record)) == ["a", "b", "c"]


def test_a_wrong_key_or_model_is_refused(proxy):
    url = proxy.gateway.url + "/v1"
    with pytest.raises(openai.AuthenticationError) as e:
        client_at(url, "wrong").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401
    assert httpx.get(url + "/models").status_code == 401
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client_at(url).chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}])


def test_an_upstream_that_is_down_is_a_502_line_not_a_traceback(record, capsys):
    running = build_proxy(ProxyConfig(upstream=dead_url(), upstream_model="tiny", port=0,
                                      record=str(record), model="tiny"))
    running.start()
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client_at(running.gateway.url + "/v1").chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}])
    finally:
        running.stop()
    assert e.value.status_code == 502
    error = e.value.body
    assert error["type"] == "upstream_error"
    assert error["message"].startswith("the sampler failed: cannot reach the sampling server")
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    # without --upstream-model the command asks the upstream, and says why it cannot
    assert main(["--upstream", dead_url(), "--port", "0", "--record", str(record)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prefixgym proxy: cannot ask http://127.0.0.1:")
    assert "\n" not in err and "Traceback" not in err


def test_the_chat_formats_stop_ids_go_upstream_and_an_upstream_5xx_is_a_502(record):
    tokenizer = load_tokenizer()
    fmt = ChatMLFormat(tokenizer)
    bodies, status = [], [200]

    def upstream(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        if status[0] != 200:
            return httpx.Response(status[0], json={"error": {"message": "engine died"}})
        return httpx.Response(200, json={
            "choices": [{"index": 0, "text": "", "token_ids": [fmt.im_end], "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.5]}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1}})

    sampler = OpenAISamplingClient("http://upstream.test", model="m",
                                   transport=httpx.MockTransport(upstream))
    running = RecordingProxy(sampler, "m", lambda: CallTree(tokenizer, fmt), record,
                             SamplingDefaults(max_tokens=5, temperature=0.5))
    running.start()
    try:
        client = client_at(running.gateway.url + "/v1", "none")
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].model_extra["token_ids"] == [fmt.im_end]
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       stop=["\n"], max_tokens=3)
        status[0] = 500
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    finally:
        running.stop()
    first, with_strings = bodies[0], bodies[1]
    assert first["prompt"] == reply.choices[0].model_extra["prompt_token_ids"]
    assert first["stop_token_ids"] == fmt.stop_token_ids  # the format's end of turn
    assert (first["max_tokens"], first["temperature"]) == (5, 0.5)  # the proxy's defaults
    assert "stop_token_ids" not in with_strings and with_strings["stop"] == ["\n"]
    assert with_strings["max_tokens"] == 3
    assert e.value.status_code == 502 and "engine died" in e.value.body["message"]
