"""ServerHTTP: one pooled httpx client to an OpenAI-compatible server; answers as JSON objects.

`OpenAISamplingClient` samples through it, and `RemoteWeights` pushes weights through it.
A path is relative to `base_url` (which ends in `/v1`); an absolute URL may name any route
of the server (`root_url` + `/update_weights_from_disk`). An HTTP 4xx answer becomes a
ValueError carrying the server's message, an unreachable server a ConnectionError, an HTTP
5xx a RuntimeError. A kept-alive connection the server closed as a request went out on it
is retried once, on a new connection. Knows HTTP and the error shapes of vLLM, SGLang and
`prefixgym serve`; nothing of sampling or weights.
"""

from __future__ import annotations

import httpx

from prefixgym.types import JSONObject

KEEPALIVE_S = 2.0  # how long an idle connection is kept for the next request


class ServerHTTP:
    def __init__(self, base_url: str, api_key: str, timeout: float, max_connections: int,
                 transport: httpx.BaseTransport | None = None) -> None:
        """`base_url` ends in `/v1` (added when missing); `transport` replaces httpx's (tests)."""
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.root_url = self.base_url.removesuffix("/v1")
        self._http = httpx.Client(
            base_url=self.base_url, timeout=timeout,
            headers={"Authorization": f"Bearer {api_key}"},
            # idle connections dropped after 2 s, before uvicorn's 5 s (vLLM's and serve's
            # default) closes them under a request
            limits=httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_S),
            transport=transport,
        )

    def call(self, method: str, path: str, body: JSONObject | None = None,
             absolute: bool = False) -> JSONObject:
        """The JSON object the server answers; `absolute`: a route that answers its 4xx
        errors in its own shape, returned as they are."""
        try:
            reply = self._send(method, path, body)
        except httpx.HTTPError as e:
            raise ConnectionError(f"cannot reach the sampling server at {self.base_url}: "
                                  f"{e}") from e
        if reply.status_code >= 400:
            if absolute and reply.status_code < 500 and _is_json_object(reply):
                return dict(reply.json())  # a route that answers its errors in its own shape
            message = _message(reply)
            error = ValueError if reply.status_code < 500 else RuntimeError
            raise error(f"the sampling server answered HTTP {reply.status_code}: {message}")
        data = reply.json()
        if not isinstance(data, dict):
            raise ValueError(  # noqa: TRY004 - a bad answer is a ValueError throughout
                f"the sampling server answered {type(data).__name__}, not an object")
        return data

    def post_first(self, routes: list[str], body: JSONObject) -> None:
        """POST `body` to the first of `routes` (paths under `root_url`) the server has;
        their answers are text."""
        for route in routes:
            try:
                reply = self._send("POST", f"{self.root_url}{route}", body)
            except httpx.HTTPError as e:
                raise ConnectionError(f"cannot reach the sampling server at {self.root_url}: "
                                      f"{e}") from e
            if reply.status_code == 404 and route != routes[-1] and "error" not in reply.text:
                continue  # no such route here: try the other server's name
            if reply.status_code >= 400:
                error = ValueError if reply.status_code < 500 else RuntimeError
                raise error(f"{self.root_url}{route} answered HTTP {reply.status_code}: "
                            f"{_message(reply)}")
            return

    def close(self) -> None:
        self._http.close()

    def _send(self, method: str, url: str, body: JSONObject | None) -> httpx.Response:
        try:
            return self._http.request(method, url, json=body)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            # a kept-alive connection the server closed as the request went out on it
            # (no answer, or a reset under load): once more, on a new connection
            return self._http.request(method, url, json=body)


def _message(reply: httpx.Response) -> str:
    try:
        data = reply.json()
    except ValueError:
        return reply.text[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
    return reply.text[:500]


def _is_json_object(reply: httpx.Response) -> bool:
    try:
        return isinstance(reply.json(), dict)
    except ValueError:
        return False
