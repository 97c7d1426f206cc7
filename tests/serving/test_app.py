"""`prefixgym serve`'s /v1/completions, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import httpx
import pytest

from prefixgym.types import ModelInput, SamplingParams

openai = pytest.importorskip("openai")

PROMPT = [(7 * i + 3) % 4000 + 50 for i in range(40)]  # 40 ordinary token ids


def post(server, payload=None, **kwargs) -> httpx.Response:
    if payload is not None:
        kwargs["json"] = payload
    return httpx.post(f"{server.url}/v1/completions", timeout=30, **kwargs)


def test_models_and_health(server, client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_token_ids_logprobs_and_cached_tokens(server, client) -> None:
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                      temperature=0.0, logprobs=1)
    choice = first.choices[0]
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 6 and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == 6
    assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
    assert first.usage.prompt_tokens == 40 and first.usage.completion_tokens == 6

    # the same request in-process: same greedy tokens and logprobs
    local = server.service.create_sampling_client().sample(
        ModelInput.from_ints(PROMPT), 1, SamplingParams(max_tokens=6, temperature=0.0)).result()
    assert local.sequences[0].tokens == ids
    assert local.sequences[0].logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)

    # a prompt that extends the first prompt + its reply reuses the cached prefix
    second = client.completions.create(model="tiny", prompt=PROMPT + ids + [60, 61],
                                       max_tokens=3, temperature=0.0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens == 48
    assert cached == 40 + 6 - 1  # every position with stored KV, the partial block's too


def test_n_samples_seed_and_text_prompt(client) -> None:
    a = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=4, seed=5)
    b = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=4, seed=5)
    ids_a = [c.model_extra["token_ids"] for c in a.choices]
    assert ids_a == [c.model_extra["token_ids"] for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert a.usage.completion_tokens == 12
    text = client.completions.create(model="tiny", prompt="Hello there", max_tokens=2)
    assert text.usage.prompt_tokens >= 2
    nested = client.completions.create(model="tiny", prompt=[PROMPT], max_tokens=2, seed=1)
    assert nested.usage.prompt_tokens == 40


def test_echo_returns_prompt_logprobs_like_compute_logprobs(server) -> None:
    reply = post(server, {"prompt": PROMPT[:10], "max_tokens": 0, "echo": True, "logprobs": 0})
    assert reply.status_code == 200
    values = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
    expected = server.service.create_sampling_client().compute_logprobs(PROMPT[:10]).result()
    assert values[0] is None and len(values) == 10
    assert values[1:] == pytest.approx(expected[1:], abs=1e-4)


def test_stop_string_is_cut_from_text_but_not_from_token_ids(server) -> None:
    probe = post(server, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}).json()
    ids = probe["choices"][0]["token_ids"]
    tok = server.service.tokenizer
    stop = tok.decode(ids[2:3]).strip()
    if not stop:
        pytest.skip("greedy token 3 decodes to whitespace")
    reply = post(server, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stop": [stop]})
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert stop not in choice["text"]
    kept = post(server, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stop": stop,
                         "include_stop_str_in_output": True}).json()["choices"][0]
    assert stop in kept["text"] and kept["token_ids"] == choice["token_ids"]


@pytest.mark.parametrize(("payload", "status", "param"), [
    ({"prompt": [1, 2, 4096], "max_tokens": 2}, 400, None),             # id outside vocab
    ({"prompt": [1, 2, 3], "max_tokens": "2"}, 400, "max_tokens"),      # wrong type
    ({"prompt": [1, 2, 3], "n": 9}, 400, "n"),                          # n over the limit
    ({"prompt": [1, 2, 3], "max_tokens": 1000}, 400, "max_tokens"),     # over the limit
    ({"prompt": [True, 2]}, 400, "prompt"),
    ({"prompt": [[1, 2], [3]]}, 400, "prompt"),                         # a batch of prompts
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1], "logprobs": 50}, 400, "logprobs"),
    ({"prompt": [1], "stream": True}, 400, "stream"),
    ({"max_tokens": 2}, 400, "prompt"),                                  # no prompt
    ({"prompt": [1], "model": "gpt-4"}, 404, "model"),
    ([1, 2, 3], 400, None),                                             # not an object
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, payload, status, param):
    reply = post(server, payload)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param
    assert post(server, {"prompt": [1, 2, 3], "max_tokens": 1}).status_code == 200


def test_malformed_and_oversized_bodies(server) -> None:
    bad_json = post(server, content=b'{"prompt": [1, 2', headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    huge = post(server, content=b"[" + b"1," * 40_000 + b"1]",
                headers={"content-type": "application/json"})
    assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/nothing").status_code == 404
    assert post(server, {"prompt": [1, 2, 3], "max_tokens": 1}).status_code == 200


def test_openai_client_sees_errors_as_bad_request(client) -> None:
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="tiny", prompt=[5, 999_999], max_tokens=1)
