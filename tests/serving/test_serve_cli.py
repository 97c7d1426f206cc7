"""`prefixgym serve` as a command: a real process on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_command_answers_openai_requests(wait_healthy) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "prefixgym", "serve", "--model", "tiny", "--port", str(port),
           "--served-model-name", "pg-tiny", "--max-n", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, attempts=600)
        client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["pg-tiny"]
        reply = client.completions.create(model="pg-tiny", prompt=[5, 6, 7], max_tokens=3,
                                          temperature=0.0, logprobs=1)
        assert len(reply.choices[0].model_extra["token_ids"]) == 3
        too_many = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "n": 3})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stdout.read().decode()[-2000:]


def test_serve_rejects_bad_flags() -> None:
    from prefixgym.cli.serve import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--port", "70000"])
    assert exit_info.value.code == 2
