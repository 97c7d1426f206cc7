"""A real `prefixgym serve` app on a free loopback port, in a thread, shared by the
session; and a real vLLM server in a process of its own (`vllm_server`, `vllm`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from real_servers import VLLMServer  # noqa: E402

from prefixgym.local_service import LocalService  # noqa: E402
from prefixgym.serving.app import create_app  # noqa: E402
from prefixgym.serving.config import ServeConfig  # noqa: E402


class RunningServer:
    def __init__(self, service: LocalService, config: ServeConfig) -> None:
        self.service = service
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(service, service.tokenizer, config), host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("prefixgym serve did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.url)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_healthy(url: str, attempts: int = 300) -> None:
    """Poll /health until it answers 200 (bounded: at most `attempts` tries)."""
    for _ in range(attempts):
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url}/health never answered")


SERVE_CONFIG = ServeConfig(model="tiny", max_n=8, max_request_tokens=1000,
                           max_body_bytes=64 * 1024)


@pytest.fixture(name="wait_healthy")
def wait_healthy_fixture():
    return wait_healthy


@pytest.fixture(name="running_server")
def running_server_fixture():
    """The RunningServer class, for a test that needs a server of its own."""
    return RunningServer


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    service = LocalService(model="tiny", seed=0)
    running = RunningServer(service, SERVE_CONFIG)
    yield running
    running.stop()
    service.close()


@pytest.fixture
def client(server: RunningServer):  # type: ignore[no-untyped-def]
    """The official openai client on the session's server (no retries)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)


@pytest.fixture
def start_server():
    """`start_server(service, config)`: a running server, stopped (and its service closed)
    when the test ends."""
    started: list[RunningServer] = []

    def start(service: LocalService, config: ServeConfig = SERVE_CONFIG) -> RunningServer:
        started.append(RunningServer(service, config))
        return started[-1]

    yield start
    for running in started:
        running.stop()
        running.service.close()


# -- a real vLLM server (tests marked `vllm`; ./run.sh test builds .venv-vllm) ------------

@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    server = VLLMServer(tmp_path_factory.mktemp("vllm"))
    yield server
    server.process.stop()


@pytest.fixture
def vllm(vllm_server: VLLMServer) -> VLLMServer:
    """The session's vLLM server, restored to the base weights for this test."""
    if vllm_server.process.process.poll() is not None:
        pytest.fail(f"the session's vLLM server died; its log: {vllm_server.log}")
    vllm_server.restore()
    return vllm_server
