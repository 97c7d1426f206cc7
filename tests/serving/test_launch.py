"""serving/launch.py without vLLM: the flags a vLLM server gets, and a server process
whose whole group ends with it (vLLM's engine processes outlive a killed API server)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from prefixgym.serving.launch import (
    VLLM_PYTHON_VARIABLE,
    ServerProcess,
    VLLMLaunch,
    find_vllm_python,
    free_port,
)


def test_vllm_gets_the_flags_rl_needs() -> None:
    launch = VLLMLaunch("/models/m", served_model_name="m", port=8001, lora_rank=4,
                        dtype="float32", api_key="k")
    argv = launch.argv("/venv/bin/python")
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(argv[3:])
    for wanted in ("--model /models/m", "--served-model-name m", "--port 8001",
                   "--block-size 32", "--enable-prefix-caching",
                   "--enable-prompt-tokens-details", "--dtype float32", "--enable-lora",
                   "--max-lora-rank 8",  # 4 rounded up to a rank vLLM takes
                   "--max-loras 2", "--api-key k"):
        assert wanted in flags, wanted
    assert launch.env()["VLLM_SERVER_DEV_MODE"] == "1"  # the full-weights routes
    assert launch.env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" not in VLLMLaunch("/models/m").argv("python")


@pytest.mark.parametrize(("fields", "message"), [
    ({"block_size": 24}, "multiple of 16"),
    ({"lora_rank": 513}, "up to 512"),
    ({"kv_cache_gib": 0}, "whole GiB"),
])
def test_a_launch_refuses_what_vllm_would_refuse_later(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VLLMLaunch("/models/m", **fields)


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stop_ends_the_whole_group_even_after_the_leader_was_killed(tmp_path: Path) -> None:
    # a leader that starts a child in its group and serves /health, as vLLM's API server
    # starts its engine processes
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(f"""
        import http.server, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(tmp_path / "child.pid")!r}, "w").write(str(child.pid))
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
            def log_message(self, *args):
                pass
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
    """))
    port = free_port()
    server = ServerProcess([sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}",
                           log_path=tmp_path / "server.log")
    server.wait_ready(timeout_s=60, progress=False)
    child = int((tmp_path / "child.pid").read_text())
    server.kill()  # the leader alone, as a crash would
    assert running(child)  # the orphan a killed vLLM API server leaves
    server.stop()
    assert not running(child)
    server.stop()  # twice is fine


def test_a_server_that_dies_at_startup_says_its_last_error(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("print('loading'); raise ValueError('No common block size for 16')\n")
    server = ServerProcess([sys.executable, str(script)], "http://127.0.0.1:9",
                           log_path=tmp_path / "broken.log", name="vLLM")
    with pytest.raises(RuntimeError, match="vLLM exited with code 1 before it answered; "
                                           "its last error: ValueError: No common block"):
        server.wait_ready(timeout_s=60, progress=False)


def test_the_local_vllm_venv_is_found_by_its_own_link_not_the_interpreter_behind_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a venv's bin/python is a link to the base interpreter, which lacks the venv's
    # packages: resolving it would start a Python without vllm
    base = tmp_path / "base-python"
    base.write_text("")
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").symlink_to(base)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(VLLM_PYTHON_VARIABLE, raising=False)
    assert find_vllm_python() == str(tmp_path / ".venv-vllm" / "bin" / "python")
