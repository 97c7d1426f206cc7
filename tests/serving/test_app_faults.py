"""`prefixgym serve` under hostile input: deep JSON, lone surrogates, negative ids,
huge numbers and prompts get one-line 4xx in OpenAI's shape; a 500 leaks nothing;
text is tokenized off the event loop; an API key guards /v1 when configured."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from prefixgym.cli.serve import main as serve_main  # noqa: E402
from prefixgym.local_service import LocalService  # noqa: E402
from prefixgym.serving.app import create_app  # noqa: E402
from prefixgym.serving.config import ServeConfig  # noqa: E402


def post(server: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=30, **kwargs)


def assert_one_line_error(reply: httpx.Response, status: int, param: str | None) -> str:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
    assert "Value error" not in error["message"]  # pydantic's wording is not ours
    return str(error["message"])


@pytest.mark.parametrize(("body", "param", "words"), [
    (b"[" * 30_000 + b"]" * 30_000, None, "nests 30000 levels deep"),  # under the 64 KiB limit
    (b'{"prompt": [1], "x": ' + b"[" * 40 + b"]" * 40 + b"}", None, "nests 41 levels"),
    (b'{"prompt": "\\ud800 hi"}', "prompt", "lone surrogate"),
    (b'{"prompt": ["\\udfff"]}', "prompt", "lone surrogate"),
    (b'{"prompt": [1], "stop": "\\ud83d"}', "stop", "lone surrogate"),
    (b'{"prompt": [5, -3, 7]}', "prompt", "token id -3"),
    (b'{"prompt": [[-1]]}', "prompt", "token id -1"),
    (b'{"prompt": [1], "max_tokens": 1' + b"0" * 5000 + b"}", None, "not valid JSON"),
    (b'{"prompt": [1], "stop_token_ids": [-4]}', None, "stop_token_ids"),
])
def test_hostile_bodies_are_one_line_4xx(server: Any, body: bytes, param: str | None,
                                         words: str) -> None:
    reply = post(server, content=body, headers={"content-type": "application/json"})
    assert words in assert_one_line_error(reply, 400, param)
    assert post(server, json={"prompt": [1, 2, 3], "max_tokens": 1}).status_code == 200


BODY_ROUTES = ["/v1/completions", "/update_weights_from_disk", "/v1/load_lora_adapter",
               "/load_lora_adapter", "/v1/unload_lora_adapter", "/unload_lora_adapter"]


def body_error(reply: httpx.Response, status: int) -> str:
    """The one-line message of a body refused with `status`, in the route's own shape
    (OpenAI's error object; SGLang's success-false answer on its weights route)."""
    assert reply.status_code == status, reply.text
    answer = reply.json()
    message = str(answer["error"]["message"] if "error" in answer else answer["message"])
    assert "\n" not in message and "codec" not in message
    return message


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_not_labelled_json_is_415_on_every_route(server: Any, route: str,
                                                        content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    reply = httpx.post(f"{server.url}{route}", content=b'{"prompt": [1], "max_tokens": 1}',
                       headers=headers, timeout=30)
    message = body_error(reply, 415)
    assert "must be JSON sent with Content-Type: application/json" in message
    assert (content_type or "no Content-Type") in message


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize(("body", "reason"), [
    ('{"prompt": [1]}'.encode("utf-16-be"), "it is not UTF-8 text (a NUL byte at offset 0: "
                                            "UTF-16?)"),
    ('{"prompt": [1]}'.encode("utf-16"), "it is not UTF-8 text (byte 0xff at offset 0)"),
    (b"\xc3\x28", "it is not UTF-8 text (byte 0xc3 at offset 0)"),
    (b"", "it is empty"),
    (b'{"prompt": [1, 2', "Expecting"),
    (b"prompt=1", "Expecting value: line 1 column 1"),
])
def test_a_body_that_is_not_json_is_400_saying_so_on_every_route(
        server: Any, route: str, body: bytes, reason: str) -> None:
    for content_type in ("application/json", "application/json; charset=utf-8"):
        reply = httpx.post(f"{server.url}{route}", content=body, timeout=30,
                           headers={"content-type": content_type})
        message = body_error(reply, 400)
        assert message.startswith("request body is not valid JSON: ") and reason in message
    assert post(server, json={"prompt": [1, 2, 3], "max_tokens": 1}).status_code == 200


def test_a_vendor_json_type_is_json(server: Any) -> None:
    reply = post(server, content=b'{"prompt": [1, 2], "max_tokens": 1}',
                 headers={"content-type": "application/vnd.api+json"})
    assert reply.status_code == 200, reply.text


def test_a_text_prompt_that_cannot_fit_is_refused_before_tokenizing(server: Any) -> None:
    # the limit is 1000 tokens; no token of the built-in tokenizer is 13+ characters... x 1000
    reply = post(server, json={"prompt": "word " * 3000, "max_tokens": 1})
    assert "cannot fit in this server's limit of 1000 tokens" in assert_one_line_error(
        reply, 400, "prompt")


class GatedTokenizer:
    """The built-in tokenizer, whose encode waits until the test opens the gate."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered, self.gate = threading.Event(), threading.Event()

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_tokenizing_does_not_block_the_event_loop(running_server: Any) -> None:
    service = LocalService(model="tiny", seed=0)
    gated = GatedTokenizer(service.tokenizer)
    service.tokenizer = gated  # type: ignore[assignment]
    running = running_server(service, ServeConfig(max_request_tokens=64))
    try:
        result: dict[str, httpx.Response] = {}
        request = threading.Thread(target=lambda: result.setdefault(
            "reply", post(running, json={"prompt": "Hello there", "max_tokens": 1})))
        request.start()
        assert gated.entered.wait(timeout=60)  # the request is inside the tokenizer now
        # were the tokenizer on the event loop, /health could not answer until the gate opens
        assert httpx.get(f"{running.url}/health", timeout=30).status_code == 200
        gated.gate.set()
        request.join(timeout=60)
        assert result["reply"].status_code == 200
    finally:
        gated.gate.set()
        running.stop()
        service.close()


@pytest.fixture
def closed_service() -> Iterator[LocalService]:
    service = LocalService(model="tiny", seed=0)
    service.close()  # every request now fails inside the engine
    yield service


def test_a_500_says_only_that_the_server_failed(closed_service: LocalService) -> None:
    client = TestClient(create_app(closed_service, closed_service.tokenizer),
                        raise_server_exceptions=False)
    reply = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert reply.status_code == 500
    message = reply.json()["error"]["message"]
    assert "closed" not in message and "RuntimeError" not in message and "\n" not in message
    assert reply.json()["error"]["type"] == "internal_error"


def test_an_api_key_guards_the_v1_routes(closed_service: LocalService) -> None:
    app = create_app(closed_service, closed_service.tokenizer, ServeConfig(api_key="s3cret"))
    client = TestClient(app, raise_server_exceptions=False)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        for reply in (client.get("/v1/models", headers=headers),
                      client.post("/v1/completions", json={"prompt": [1]}, headers=headers),
                      client.post("/v1/chat/completions", headers=headers,
                                  json={"messages": [{"role": "user", "content": "hi"}]})):
            assert reply.status_code == 401
            assert reply.json()["error"]["type"] == "authentication_error"
    good = {"Authorization": "Bearer s3cret"}
    assert client.get("/v1/models", headers=good).status_code == 200
    assert client.get("/health").status_code == 200  # open, for load balancers


def test_binding_beyond_loopback_without_a_key_warns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFIXGYM_API_KEY", raising=False)
    for host, warned in (("0.0.0.0", True), ("example.org", True), ("127.0.0.1", False),
                         ("::1", False), ("localhost", False)):
        # a model that does not load stops the command right after the warning
        assert serve_main(["--host", host, "--model", "/no/such/model"]) == 2
        err = capsys.readouterr().err
        assert ("no API key is set" in err) == warned, (host, err)
        assert "cannot load model" in err
    monkeypatch.setenv("PREFIXGYM_API_KEY", "from-the-environment")
    assert serve_main(["--host", "0.0.0.0", "--model", "/no/such/model"]) == 2
    assert "no API key" not in capsys.readouterr().err
